"""The benchmarks: measurements of quillgpt, kept out of the package a user's program imports (nothing in quillgpt/
imports from here; tests/test_layout.py holds the code to that).

bench.py's modes, one module each; bench.py parses the command line, picks the mode and calls its run():

    training_step     the training step (the default, no mode flag): ms/iter, tokens/s, MFU; --baseline, --profile
    against           --against REV: this checkout's training step against a commit's, ABBA rounds of processes
    kernel_times      --kernels: a compiled CPU step's time per kernel, by clock
    decoding          --sample: batch-1 decoding tokens/s with and without the KV cache, compiled, int8
    hellaswag         --hellaswag: seconds per 1,000 HellaSwag items
    prepare_speed     --prepare: BPE training time, prepare.py's MB/s and peak RSS with 1 and N workers
    memory            --memory: training RSS on a large train.bin against a small one
    precision_curves  --precision-curves: val loss of fp32 against bf16 training
    muon              --muon: Muon's step, a Newton-Schulz chain per matrix against one per shape
    finetune          --finetune: fine-tuning SmolLM2-135M's shape beside train.py --validate's estimate
    chat_rows         --chat: masked against unmasked loss step time; packed against padded rows
    probe             --probe: the CPU path (capability, oneDNN's ISA) and fp32 against bf16 matmul rates
    vs_transformers   --vs-transformers: batch-1 greedy decoding, sample.py's default against HF generate
    serving_load      --serve: serve.py's aggregate tokens/s with 1, 8 and 16 concurrent clients
    gpu_check         --gpu: the GPU check (pytest -m cuda, 124M and tiny Shakespeare against nanoGPT, decoding,
                      serving), in two parts of ~8 minutes; --tiny --device cpu runs its code on a CPU

Each mode module declares MODE: its flag, its own flags with their defaults, and its run(). Beside them:

    common            what several modes share: the Mode each declares, timed training steps, the matmul ceiling,
                      child processes, tables
    conditions        what a measurement runs under: the AVX2-only CPU path (--isa avx2), the load line, tiny
                      Shakespeare's and a nanoGPT checkout's location
    trainer_runs      trainers run as users run them, timed from outside by the lines they print (our train.py,
                      nanoGPT's); random local tokens for any vocabulary

and the measurements that run on their own, from the repository root:

    python -m benchmarks.vs_nanogpt --nanogpt DIR   the CPU preset's step against nanoGPT's own train.py
    python -m benchmarks.soak                       a long training run: RSS, checkpoints and resume hold steady
    python -m benchmarks.soak_serve                 serve.py under 1,000 mixed requests: RSS holds steady
"""
