"""config.py: the schema, TOML + overrides, one-line validation messages, presets, the reference in docs/config.md."""

import dataclasses
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, tiny_overrides

from quillgpt import config as config_mod
from quillgpt.config import ConfigError, build_config, load_config, markdown_reference, parse_overrides, to_toml
from quillgpt.errors import run_main

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# (TOML text or None, extra CLI args, expected fragment of the one-line error)
BAD_CONFIGS = [
    ("[trainig]\nbatch_size = 4", [], "unknown section [trainig] (did you mean 'training'?)"),
    ("[training]\nbatch_sise = 4", [], "unknown key 'training.batch_sise' (did you mean 'batch_size'?)"),
    (
        "[training]\nlearning_rate = 1e-3",
        [],
        "unknown key 'training.learning_rate' (did you mean 'optimizer.learning_rate'?)",
    ),
    ("batch_size = 4", [], "top-level key 'batch_size' is not a section"),
    ("[training]\nbatch_size = 4.5", [], "training.batch_size = 4.5 has the wrong type, expected int"),
    ('[training]\nbatch_size = "8"', [], "training.batch_size = '8' has the wrong type, expected int"),
    ('[optimizer]\nlearning_rate = "fast"', [], "optimizer.learning_rate = 'fast' has the wrong type, expected float"),
    ("[model]\nbias = 1", [], "model.bias = 1 has the wrong type, expected bool"),
    ("[training]\nbatch_size = 0", [], "training.batch_size = 0 must be positive"),
    ("[training]\ngrad_accum_steps = -2", [], "training.grad_accum_steps = -2 must be positive"),
    ("[training]\nmax_iters = 0", [], "training.max_iters = 0 must be positive"),
    ("[optimizer]\nlearning_rate = 0.0", [], "optimizer.learning_rate = 0.0 must be positive"),
    ("[optimizer]\ngrad_clip = -1.0", [], "optimizer.grad_clip = -1.0 must be >= 0"),
    ("[optimizer]\nwarmup_iters = -5", [], "optimizer.warmup_iters = -5 must be >= 0"),
    ("[training]\neval_interval = -1", [], "training.eval_interval = -1 must be >= 0"),
    ("[training]\nsave_interval = -1", [], "training.save_interval = -1 must be >= 0"),
    ("[training]\nlog_interval = -10", [], "training.log_interval = -10 must be >= 0"),
    ("[optimizer]\nweight_decay = -0.1", [], "optimizer.weight_decay = -0.1 must be >= 0"),
    ('[training]\nprecision = "fp8"', [], "training.precision = 'fp8' must be one of fp32 | fp16 | bf16 | auto"),
    ("[model]\nn_embd = 100\nn_head = 3", [], "model.n_embd = 100 is not divisible by model.n_head = 3"),
    ("[model]\ndropout = 1.0", [], "model.dropout = 1.0 must be in [0, 1)"),
    ("[model]\ndropout = -0.1", [], "model.dropout = -0.1 must be in [0, 1)"),
    (
        "[training]\nglobal_batch_size = 64\nbatch_size = 12\ngrad_accum_steps = 2",
        [],
        "training.global_batch_size = 64 but batch_size 12 x grad_accum_steps 2 x world_size 1 = 24",
    ),
    (
        "[training]\nglobal_batch_size = 8\nbatch_size = 12",
        [],
        "training.batch_size = 12 exceeds training.global_batch_size = 8",
    ),
    ('[run]\ndevice = "tpu"', [], "run.device = 'tpu' must be auto | cpu | cuda | cuda:N | mps"),
    ("[training\nbatch_size = 4", [], "invalid TOML"),
    ('[model]\npos_emb = "alibi"', [], "model.pos_emb = 'alibi' must be one of learned | rope"),
    ('[optimizer]\nname = "sgd"', [], "optimizer.name = 'sgd' must be one of adamw | muon"),
    ("[optimizer]\nmin_lr = 0.1\nlearning_rate = 0.01", [], "optimizer.min_lr = 0.1 must be in [0, learning_rate]"),
    (
        None,
        ["--training.batch_size", "many"],
        "command line: training.batch_size = 'many' has the wrong type, expected int",
    ),
    (None, ["--max-iter", "5"], "unknown option '--max-iter' (did you mean 'max-iters'?)"),
    (None, ["--model.n_layer"], "--model.n_layer needs a value"),
    (None, ["--device", "cuda"], "run.device = 'cuda' but this machine has no CUDA device"),
]


def run_cli(argv, capsys) -> tuple[int, str]:
    import train

    with pytest.raises(SystemExit) as exc:
        run_main(lambda: train.main(argv))
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("toml,args,fragment", BAD_CONFIGS, ids=[f"bad{i}" for i in range(len(BAD_CONFIGS))])
def test_bad_config_exits_2_with_one_line(toml, args, fragment, tmp_path, capsys, tiny_data):
    if "cuda" in fragment:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    argv = list(args) + [f"--data.data_dir={tiny_data}", "--data.dataset=tiny", f"--run.out_dir={tmp_path}"]
    if toml is not None:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
        argv = ["--config", str(path), *argv]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err
    assert all(line.startswith("error: ") for line in err.strip().splitlines())


def test_a_block_or_vocab_size_the_dataset_cannot_take_exits_2(tiny_data, tmp_path, capsys):
    base = [f"--data.data_dir={tiny_data}", "--data.dataset=tiny", f"--run.out_dir={tmp_path}", "--max-iters=2"]
    code, err = run_cli([*base, "--model.block_size", "200000"], capsys)
    assert code == 2 and "fewer than block_size + 1" in err
    code, err = run_cli([*base, "--model.vocab_size", "10"], capsys)
    assert code == 2 and "model.vocab_size = 10 is smaller than the dataset's vocabulary" in err


def test_all_errors_in_a_file_are_reported_together(tmp_path):
    path = tmp_path / "many.toml"
    path.write_text('[training]\nbatch_size = 0\nmax_iters = -1\nprecision = "x"\n[model]\ndropout = 2.0\nbogus = 1\n')
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    lines = str(exc.value).splitlines()
    assert len(lines) == 5
    assert any("bogus" in line for line in lines) and any("dropout" in line for line in lines)


@pytest.mark.slow
def test_real_subprocess_error_has_no_traceback(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nn_embd = 100\nn_head = 3\n")
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", str(path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: model.n_embd = 100 is not divisible by model.n_head = 3"


def test_cli_overrides_toml_and_toml_overrides_the_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nbatch_size = 7\nmax_iters = 100\n[optimizer]\nlearning_rate = 1e-3\n")
    cfg = load_config(path, ["--training.max_iters", "5", "--optimizer.learning_rate=2e-3"])
    assert cfg.training.batch_size == 7  # TOML over default
    assert cfg.training.max_iters == 5  # CLI over TOML
    assert cfg.optimizer.learning_rate == 2e-3
    assert cfg.training.grad_accum_steps == 1  # default


@pytest.mark.parametrize(
    "arg,key,expected",
    [
        ("--training.max_iters=12", "training.max_iters", 12),  # int
        ("--optimizer.learning_rate=3e-4", "optimizer.learning_rate", 3e-4),  # float
        ("--optimizer.learning_rate=1", "optimizer.learning_rate", 1.0),  # int for a float field
        ("--model.bias=false", "model.bias", False),  # bool
        ("--model.bias=True", "model.bias", True),
        ("--training.eval_only=yes", "training.eval_only", True),
        ("--run.name=my run", "run.name", "my run"),  # bare str
        ('--run.name="1e3"', "run.name", "1e3"),  # quoted str that looks numeric
        ("--data.input=none", "data.input", None),  # optional -> None
        ("--model.vocab_size=512", "model.vocab_size", 512),  # optional int
        ("--training.compile=true", "training.compile", True),  # optional bool
        ("--max-iters=9", "training.max_iters", 9),  # short flags
        ("--device=cpu", "run.device", "cpu"),
        ("--tokenizer=bpe", "data.tokenizer", "bpe"),
    ],
)
def test_an_override_parses_to_its_fields_type_in_either_flag_form(arg, key, expected):
    cfg = build_config(None, parse_overrides([arg]))
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == expected
    # the space-separated form parses the same
    flag, value = arg.split("=", 1)
    cfg2 = build_config(None, parse_overrides([flag, value]))
    assert getattr(getattr(cfg2, section), name) == expected


def test_a_key_under_its_old_name_is_an_error_naming_the_new_one(tmp_path):
    """data_format moved from [training] to [data], compile from [model] to [training]. Only a checkpoint written
    before the move reads the old names (test_train.py's 14e5811 fixture); a config file or command line with an
    old name is one error per key, naming the new one."""
    path = tmp_path / "old.toml"
    path.write_text('[model]\nn_layer = 3\ncompile = true\n[training]\ndata_format = "txt"\nmax_iters = 9\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).splitlines() == [
        f"{path}: unknown key 'model.compile' (it is now training.compile)",
        f"{path}: unknown key 'training.data_format' (it is now data.data_format)",
    ]
    with pytest.raises(ConfigError, match=r"unknown key 'model.compile' \(it is now training.compile\)"):
        load_config(None, ["--model.compile=false"])


def test_the_model_arguments_carry_no_training_switch():
    """What a checkpoint stores as model_args rebuilds the model and holds nothing else (compile is training's)."""
    from quillgpt.config import GPTConfig

    cfg = build_config(None, {"training.compile": True})
    assert (
        set(cfg.model_args()) == {f.name for f in dataclasses.fields(GPTConfig)} and "compile" not in cfg.model_args()
    )


def test_list_typed_fields_coerce_and_parse_from_the_command_line():
    """No field is a list yet; the coercion for list types still works for when one is added."""
    from quillgpt.typecheck import coerce

    assert coerce([1, 2], list[int]) == [1, 2]
    with pytest.raises(TypeError):
        coerce([1, "x"], list[int])
    assert config_mod.parse_cli_value("[1, 2, 3]") == [1, 2, 3]


def test_saved_config_reloads_equal():
    cfg = build_config(
        None,
        {
            "run.name": 'x"y',
            "training.max_iters": 77,
            "model.bias": False,
            "optimizer.learning_rate": 1.5e-4,
            "model.vocab_size": 321,
            "data.input": "a\\b.txt",
        },
    )
    again = build_config(tomllib.loads(to_toml(cfg)))
    assert again == cfg
    assert build_config(config_mod.layer_from_dict(cfg.to_dict())) == cfg  # as stored in checkpoints


PRESETS = sorted((REPO_ROOT / "configs").rglob("*.toml"))


@pytest.mark.parametrize("preset", PRESETS, ids=[str(p.relative_to(REPO_ROOT / "configs")) for p in PRESETS])
def test_every_preset_validates(preset):
    cfg = load_config(preset)
    assert cfg.run.name
    assert (cfg.training.max_iters > 0) and (cfg.model.n_embd % cfg.model.n_head == 0)


def test_the_documented_presets_exist():
    names = {str(p.relative_to(REPO_ROOT / "configs")) for p in PRESETS}
    assert {"base/base.toml", "shakespeare_char/cpu.toml", "shakespeare_char/gpu.toml", "gpt2/124M.toml"} <= names
    assert any(n.startswith("finetune/") for n in names)


def test_nanogpt_shakespeare_presets_match_nanogpt():
    gpu = load_config(REPO_ROOT / "configs/shakespeare_char/gpu.toml")
    assert (gpu.model.n_layer, gpu.model.n_head, gpu.model.n_embd, gpu.model.block_size) == (6, 6, 384, 256)
    assert (gpu.training.batch_size, gpu.training.max_iters, gpu.optimizer.learning_rate, gpu.model.dropout) == (
        64,
        5000,
        1e-3,
        0.2,
    )
    cpu = load_config(REPO_ROOT / "configs/shakespeare_char/cpu.toml")
    assert (cpu.model.n_layer, cpu.model.n_head, cpu.model.n_embd, cpu.model.block_size) == (4, 4, 128, 64)
    assert (cpu.training.batch_size, cpu.training.max_iters, cpu.optimizer.lr_decay_iters) == (12, 2000, 2000)
    assert (cpu.model.dropout, cpu.training.eval_iters, cpu.optimizer.learning_rate) == (0.0, 20, 1e-3)


def test_config_keys_users_know_from_other_trainers_exist():
    names = {f"{s}.{f.name}" for s in config_mod.SECTIONS for f in dataclasses.fields(config_mod.SECTIONS[s])}
    assert {
        "training.batch_size",
        "training.grad_accum_steps",
        "training.precision",
        "training.early_stopping",
        "training.early_stopping_patience",
        "training.early_stopping_min_delta",
        "training.save_best",
        "data.data_format",
        "data.processed_dir",
    } <= names


def test_every_field_has_a_description():
    for section, cls in config_mod.SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{section}.{f.name} has no description"


def test_docs_config_reference_is_generated_from_the_schema():
    page = (REPO_ROOT / "docs" / "config.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    assert start in page and end in page
    assert page.split(start)[1].split(end)[0] == markdown_reference(), (
        "docs/config.md is stale: python -m quillgpt.config --markdown, paste between the markers"
    )


def test_validate_reports_size_memory_and_time_and_writes_nothing(tiny_data, tmp_path, capsys):
    argv = [
        f"--data.data_dir={tiny_data}",
        "--data.dataset=tiny",
        f"--run.out_dir={tmp_path}",
        "--validate",
        *[f"--{k}={v}" for k, v in tiny_overrides(tiny_data, tmp_path).items()],
    ]
    import train

    with pytest.raises(SystemExit) as exc:
        run_main(lambda: train.main(argv))
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for fragment in (
        "parameters",
        "tokens per optimizer step: 128",
        "memory estimate",
        "ms/iter",
        "estimated run",
        "ok:",
    ):
        assert fragment in out
    assert not (tmp_path / "t").exists()  # validating writes nothing


def test_validate_refuses_what_cannot_fit(tiny_data, tmp_path, capsys):
    argv = [
        f"--data.data_dir={tiny_data}",
        "--data.dataset=tiny",
        f"--run.out_dir={tmp_path}",
        "--validate",
        "--model.n_layer=96",
        "--model.n_embd=8192",
        "--model.n_head=64",
        "--model.block_size=64",
        "--training.batch_size=256",
    ]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "would not fit" in err


def test_one_gpu_named_for_several_ranks_is_refused():
    """run.device = cuda:0 under torchrun would put every rank on GPU 0 (NCCL then fails with "Duplicate GPU")."""
    with pytest.raises(ConfigError, match=r"run.device = 'cuda:0' would put all 2 ranks on one GPU: use run.device"):
        build_config(None, {"run.device": "cuda:0"}, world_size=2)
    assert build_config(None, {"run.device": "cuda:1"}, world_size=1).run.device == "cuda:1"
    assert build_config(None, {"run.device": "cuda"}, world_size=2).run.device == "cuda"


@pytest.mark.parametrize(
    "overrides, line",
    [
        ({"dpo.beta": "nan"}, "dpo.beta = nan must be a finite number"),
        ({"dpo.sft_weight": "nan"}, "dpo.sft_weight = nan must be a finite number"),
        ({"rl.enabled": "true", "rl.group_size": "0", "run.init_from": "x.pt"}, "rl.group_size = 0 must be positive"),
        ({"rl.enabled": "true", "rl.kl_coef": "-1", "run.init_from": "x.pt"}, "rl.kl_coef = -1.0 must be >= 0"),
        ({"rl.enabled": "true", "rl.top_k": "-1", "run.init_from": "x.pt"}, "rl.top_k = -1 must be >= 0"),
    ],
)
def test_one_mistake_is_one_line_naming_the_key_that_was_set(overrides, line):
    """The config is checked one section at a time, one line per key: its first problem only (a NaN beta is not
    finite, and is not also said to be non-positive), and a rule names the key it is about."""
    argv = [part for key, value in overrides.items() for part in (f"--{key}", value)]
    with pytest.raises(ConfigError) as e:
        build_config(None, parse_overrides(argv))
    [only] = str(e.value).splitlines()
    assert only.startswith(line), only
