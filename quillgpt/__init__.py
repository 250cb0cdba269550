"""quillgpt's engine: what the scripts at the repository root (train, sample, chat, serve, prepare, eval, export,
bench, speedrun) and model.py are built from. Each module owns one thing:

    errors       the user-error convention: one line, exit 2
    fields       the typed-field check of what is read from outside (TOML, checkpoints, JSON)
    files        atomic writes, JSON and hashes
    machine      cores, load, malloc settings, where tiny Shakespeare lives
    network      the offline check before the Hugging Face hub
    precision    the precisions a run can use and their dtypes
    config       the typed TOML config: schema, overrides, checks
    tokenizer    char, BPE, tiktoken and Hugging Face tokenizers
    chat_template  conversations -> ids and assistant masks through a sandboxed chat template
    corpus       reading sources: text, folders, jsonl, parquet, hub datasets
    prepare/     corpus -> train.bin / val.bin / meta.json (recipes, request, sources, splits, pool,
                 workdir, reuse, nanogpt_layout, pipeline)
    data         datasets and batches
    kernels      the CPU attention and dropout ops model.py uses
    optim        AdamW and Muon, the LR schedule
    distributed  DDP / FSDP set-up and torchrun
    checkpoint   atomic checkpoints, run directories, resume
    metrics      training lines, train_log.json, loss curve, MFU
    trainer      the training loop
    feasibility  train.py --validate: memory and time estimates
    loading      a model from a checkpoint, .safetensors file or Hugging Face directory
    hf           Hugging Face import and export
    gguf_export  GGUF files for llama.cpp and Ollama
    generate     prompts in, text out
    chat_session a multi-turn conversation over one KV cache (chat.py's library)
    tasks        synthetic chat tasks with checkable answers
    engine       continuous batching: many requests' decoding steps as one batch
    serving      serve.py's OpenAI-compatible API
    scoring      bits per byte and HellaSwag
    lm_harness   the lm-evaluation-harness adapter
    evaluate     eval.py's library
    bench/       bench.py's modes, one module each

The scripts and this package run from the repository root, as nanoGPT's do (see README.md).
"""
