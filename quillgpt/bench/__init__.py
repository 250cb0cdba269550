"""bench.py's benchmarks, one module a mode; bench.py parses the command line, picks the mode and calls its run().

    training          the training step (the default, no mode flag): ms/iter, tokens/s, MFU; --baseline, --profile
    against           --against REV: this checkout's training step against a commit's, ABBA rounds of processes
    kernels           --kernels: a compiled CPU step's time per kernel, by clock
    sample            --sample: batch-1 decoding tokens/s with and without the KV cache, compiled, int8
    hellaswag         --hellaswag: seconds per 1,000 HellaSwag items
    prepare           --prepare: BPE training time, prepare.py's MB/s and peak RSS with 1 and N workers
    memory            --memory: training RSS on a large train.bin against a small one
    precision_curves  --precision-curves: val loss of fp32 against bf16 training
    muon              --muon: Muon's step, a Newton-Schulz chain per matrix against one per shape
    finetune          --finetune: fine-tuning SmolLM2-135M's shape beside train.py --validate's estimate
    common            what several modes share: the Mode each declares, timed training steps, the matmul ceiling,
                      child processes, tables

Each mode module declares MODE: its flag, its own flags with their defaults, and its run().
"""
