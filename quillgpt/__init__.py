"""quillgpt: the package the scripts at the repository root (train, sample, chat, serve, prepare, tasks, eval,
export, bench, speedrun) and model.py are built from, and what your own program imports. Each module owns one thing:

    errors        the user-error convention: one line, exit 2
    typecheck     the check of what is read from outside (TOML, checkpoints, JSON) against a type
    files         atomic writes, JSON and hashes
    machine       usable cores, malloc settings
    network       the offline check before the Hugging Face hub
    precision     the precisions a run can use and their dtypes
    config        the typed TOML config: schema, overrides, checks
    tokenizer     char, BPE, tiktoken and Hugging Face tokenizers
    chat_template conversations -> ids and assistant masks through a sandboxed chat template
    corpus        reading sources: text, folders, jsonl, parquet, hub datasets
    prepare/      corpus -> train.bin / val.bin / meta.json (recipes, request, sources, splits, pool,
                  workdir, reuse, nanogpt_layout, pipeline)
    data          datasets and batches
    kernels       the CPU attention and dropout ops model.py uses
    optim         AdamW and Muon, the LR schedule
    distributed   DDP / FSDP set-up and torchrun
    checkpoint    atomic checkpoints, run directories, resume
    metrics       training lines, train_log.json, loss curve, MFU
    run_model     the model a run trains: resumed, run.init_from's or new, decided once
    trainer       the training loop
    feasibility   train.py --validate: memory and time estimates
    loading       a model from a checkpoint, .safetensors file or Hugging Face directory
    hf            Hugging Face import and export
    gguf_export   GGUF files for llama.cpp and Ollama
    generate      prompts in, text out
    chat_session  a multi-turn conversation over one KV cache (chat.py's library)
    tasks         synthetic chat tasks with checkable answers
    serve/        serve.py's OpenAI-compatible server: batcher, requests, app
    scoring       bits per byte and HellaSwag
    lm_harness    the lm-evaluation-harness adapter
    evaluate      eval.py's library

The measurements of all this live outside the package, in benchmarks/ (bench.py's modes), which nothing here
imports. The scripts and this package run from the repository root, as nanoGPT's do (see README.md).
"""
