"""The benchmarks, kept out of the package a user's program imports (tests/test_layout.py), and only the living ones:
those docs/benchmarks.md's tables cite and a user reruns. bench.py's modes (training_step, moe, probe,
vs_transformers, serving_load, gpu_check; each module declares its MODE), python -m benchmarks.vs_nanogpt and
benchmarks.chat_demo, and what they share: common (the Mode, timed steps, child processes, tables), conditions (the
CPU path, the load line, local inputs) and trainer_runs (trainers timed by the lines they print). The retired ones
are in git: docs/LOG.md names each, its last numbers and where its code is.
"""
