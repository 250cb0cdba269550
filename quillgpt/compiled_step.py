"""One-token decoding compiled ahead of time (AOTInductor), kept on disk between runs.

The model's forward pass for one token over one row of the cache (engine.GraphCache: the whole row attended, its
unwritten part masked, so one graph serves every position) is exported with torch.export and compiled by AOTInductor into a shared library packaged as a
.pt2 file. Each step then runs in C++: no Python per layer, the elementwise work fused. The weights are the compiled
model's constants, copied in from the model being decoded (bind: a third faster than handing them in as inputs), so
a package holds no weights and serves every model of its shape: a run's checkpoints, its fine-tunes. The cache is
the compiled model's buffers too, pointed at the caller's tensors: the prompt's pass stays eager and fills the same
cache the compiled steps go on writing. (Taking the cache as inputs written in place was slower than the eager step:
the exported graph copies them.)

Compiling takes tens of seconds on a CPU, once per model shape and dtype (sample.py --compile, for the call's
cache length; chat.py's for the whole context, which a conversation grows into); loading a kept package takes a
tenth of a second, so the scripts use one whenever it is there (the decoding plan says so), the one with the
shortest cache that holds the call's positions. Packages are kept in $QUILLGPT_CACHE/decode (else ~/.cache/quillgpt/decode), named by a hash of
everything the compiled code depends on (the weights' names and shapes, the model's arguments, the batch and dtype,
torch's version and the CPU's code path: an AVX2-capped process gets its own) and the cache's length.
Measured: docs/sampling.md.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from itertools import chain, count
from pathlib import Path

import torch
import torch.nn as nn

from quillgpt.decoding_kernels import SPLIT_MAX_ROWS, SPLIT_MIN_ELEMENTS
from quillgpt.engine import GraphCache, KVCache
from quillgpt.errors import UserError
from quillgpt.files import cache_dir, fsync_dir, sha256_file
from quillgpt.precision import CPU_PATH_ENV

# Inductor's settings for a step whose linear maps split (decoding_kernels.DecodingLinear), where inductor writes the matrix-vector
# products as its own loops: a pointwise result of more than one op (a layer norm's output) is computed once into a
# buffer. Left inlined, as by default on the CPU (up to 50 ops), it is recomputed inside the next product for every
# output row: 2.6 against 1.25 ms a token (docs/LOG.md). Elsewhere (extern matmuls) the buffers cost ~7%.
SPLIT_STEP_CONFIGS = {"realize_cpu_opcount_threshold": 1}
_loaded: dict[Path, Callable] = {}  # packages loaded in this process, by file
_bound: dict[int, int] = {}  # each loaded runner's binding: the ticket of the step whose model and cache it holds
_tickets = count()


class DecodeOne(nn.Module):
    """The model's forward pass for one token (1, 1) at `position` (1,) over a cache row of its own -> logits (1, V):
    what torch.export takes. The row's buffers (k0, v0, k1, ...) are the compiled model's too, and a caller binds
    its own cache's tensors in their place (bind), so the eager prompt pass and the compiled steps write one cache."""

    def __init__(self, model: nn.Module, k: list[torch.Tensor], v: list[torch.Tensor], ids: torch.Tensor):
        super().__init__()
        self.model, self.n_layer = model, len(k)
        for i, (ki, vi) in enumerate(zip(k, v)):
            self.register_buffer(f"k{i}", torch.zeros_like(ki))
            self.register_buffer(f"v{i}", torch.zeros_like(vi))
        if model.config.smear:  # the row's tokens: smear reads the one before
            self.register_buffer("ids", torch.zeros_like(ids))

    def forward(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        k = [getattr(self, f"k{i}") for i in range(self.n_layer)]
        v = [getattr(self, f"v{i}") for i in range(self.n_layer)]
        logits, _ = self.model(token, cache=GraphCache(k, v, position, getattr(self, "ids", None)))
        return logits[:, -1, :]


class Row0:
    """The first row of a KVCache's buffers, (1, nkv, L, hs) views and its tokens (1, L): what a compiled step binds
    and writes."""

    def __init__(self, cache: KVCache):
        self.k, self.v, self.ids = [b[:1] for b in cache.k], [b[:1] for b in cache.v], cache.ids[:1]


def bind(runner, model: nn.Module, cache) -> None:
    """Give the compiled model this model's weights and point its cache buffers at the caller's cache tensors. The
    weights are copied into the runner's own memory (a few milliseconds for a small model, once per generation): a
    package keeps none of its own, so one package serves every model of its shape. The cache is not copied: its
    tensors must outlive the binding (the kernels write them in place)."""
    names = set(runner.get_constant_fqns())
    named = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    weights = {f"model.{name}": t.detach() for name, t in named if f"model.{name}" in names}  # tied ones by each name
    runner.load_constants(weights, False, False, False, False)  # the active set, no full check, copied
    tensors = {f"{kind}{i}": t for kind in "kv" for i, t in enumerate(getattr(cache, kind))}
    if model.config.smear:
        tensors["ids"] = cache.ids
    runner.load_constants(tensors, False, False, True, False)  # user-managed: the kernels write the caller's cache


def package_key(model: nn.Module, batch: int) -> str:
    """A hash of what the compiled code depends on but the cache's length (a package's file name carries that), not
    the weights' values (bind copies those in): the weights' names, dtypes and shapes, the model's arguments and
    modules, the batch, torch's version, the CPU's code path and how its linear maps split (DecodingLinear)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
    facts = {
        "config": model.config.to_dict(),
        "modules": sorted({type(m).__name__ for m in model.modules()}),  # int8 linears, LoRA...
        "batch": batch,
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ.get(k, "") for k in CPU_PATH_ENV},
        # the graph's linear maps, and inductor's settings, differ where they split (by parts, and the split's bounds)
        "split_linear": splits(model) and [sorted(split_parts(model)), SPLIT_MIN_ELEMENTS, SPLIT_MAX_ROWS],
    }
    digest.update(json.dumps(facts, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def split_parts(model: nn.Module) -> set[int]:
    """The row blocks the model's decoding products split into (decoding_kernels.DecodingLinear; 1: not split)."""
    return {getattr(m, "parts", 1) for m in model.modules()} - {1}


def splits(model: nn.Module) -> bool:
    """Whether a compiled step's linear maps in this model split (the plan swapped split products in)."""
    return bool(split_parts(model))


def packages_dir() -> Path:
    return cache_dir() / "decode"


def package_name(key: str, length: int, digest: str) -> str:
    """<key>-<length>-<digest>.pt2: the cache length the package holds, and the first DIGEST_CHARS of its sha256,
    which loading checks (verified). The digest is in the name, not in a file beside it, so that a package and its
    digest appear in one rename: two processes keeping the same step at once each keep a whole, valid file."""
    return f"{key}-{length}-{digest[:DIGEST_CHARS]}.pt2"


DIGEST_CHARS = 16


def kept_packages(key: str) -> list[tuple[int, Path]]:
    """The kept packages of this key, (cache length, file), shortest cache first."""
    found = []
    for path in packages_dir().glob(f"{key}-*.pt2"):
        parts = path.stem.removeprefix(f"{key}-").split("-")
        if len(parts) == 2 and parts[0].isdigit():
            found.append((int(parts[0]), path))
    return sorted(found)


def kept_package(model: nn.Module, batch: int, length: int, build: bool) -> Path | None:
    """The file of the kept package of this model's shape and batch with the shortest cache that holds `length`
    positions, or (build) of one compiled for `length` and kept first; None where none is kept and build is false.
    A kept package whose contents no longer match its digest is removed, with one line, and never loaded. Where the
    cache directory can't be written, a package is compiled into a temporary directory for this process alone, with
    one line saying that nothing was kept and why."""
    key = package_key(model, batch)
    for kept_length, path in kept_packages(key):
        if kept_length >= length and verified(path):
            return path
    if not build:
        return None
    return compile_package(model, KVCache.for_model(model, batch, length), key)


_verified: set[Path] = set()  # packages whose digest this process has checked


def verified(path: Path) -> bool:
    """Whether the package's sha256 still begins with the digest its name carries (a file cut short, overwritten
    in part, or anything but what was kept fails: a damaged step would decode wrong text, or fail to load). A
    damaged one is removed, with one line, so that the next --compile keeps a new one."""
    if path in _verified:
        return True
    try:
        whole = sha256_file(path).startswith(path.stem.rsplit("-", 1)[1])
    except OSError:
        whole = False
    if whole:
        _verified.add(path)
        return True
    print(
        f"[the kept decoding step {path} is damaged (its sha256 is not the one it was kept with): removed, not loaded]",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(OSError):
        path.unlink()
    return False


def package_length(path: Path) -> int:
    """The cache length a package was compiled for (its file name's <key>-<length>-<digest>.pt2)."""
    return int(path.stem.rsplit("-", 2)[1])


class NotLoaded(Exception):
    """A package that passed its digest check but does not load (a torch or library it was not built against)."""


def compiled_row_step(path: Path, model: nn.Module, cache: KVCache) -> Callable | None:
    """A kept package's step over row 0 of `cache` (whose length must be the package's), as the engine calls a step:
    (token (1, 1), cache) -> logits (1, V), the row's position advanced. Loaded once per process; None, with one
    line, where it does not load (the engine then decodes eagerly)."""
    row = Row0(cache)
    try:
        runner = loaded_runner(path)
    except NotLoaded as e:
        print(f"[{e}: decoding eagerly]", file=sys.stderr, flush=True)
        return None
    positions = torch.arange(cache.length, device=cache.device)  # each step's position, on the device
    ticket = next(_tickets)

    def step(token: torch.Tensor, given: KVCache) -> torch.Tensor:
        assert given is cache, "a compiled step decodes over the cache it was bound to"
        if _bound.get(id(runner)) != ticket:  # another model or cache used the runner since: bind again
            bind(runner, model, row)
            _bound[id(runner)] = ticket
        at = cache.positions[0]
        logits = runner.run([token, positions[at : at + 1]])[0]
        cache.positions[0] = at + 1
        return logits

    return step


def loaded_runner(path: Path):
    """The package's runner, loaded once per process. NotLoaded where it does not load."""
    if path not in _loaded:
        # the package's own C++ loader: torch._inductor.aoti_load_package would import inductor's Python first,
        # seconds of a process's start-up for the same loader
        try:
            _loaded[path] = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        except Exception as e:  # the loader's own errors are RuntimeErrors of many lines
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise NotLoaded(f"the kept decoding step {path} does not load ({first})") from None
    return _loaded[path]


def graph_row_step(model: nn.Module, cache: KVCache) -> Callable:
    """Off the CPU: a lone row's step under torch.compile, one fixed-shape graph over row 0 of the whole cache (the
    unwritten part masked), compiled once per model (kept on it) and shape."""
    if getattr(model, "_graph_step", None) is None:

        def forward(token, position, k, v, ids):
            logits, _ = model(token, cache=GraphCache(k, v, position, ids))
            return logits[:, -1, :]

        model._graph_step = torch.compile(forward, dynamic=False, fullgraph=True)
    row = Row0(cache)
    positions = torch.arange(cache.length, device=cache.device)

    def step(token: torch.Tensor, given: KVCache) -> torch.Tensor:
        at = cache.positions[0]
        logits = model._graph_step(token, positions[at : at + 1], row.k, row.v, row.ids)
        cache.positions[0] = at + 1
        return logits

    return step


def compile_package(model: nn.Module, cache, key: str) -> Path:
    """Export and compile the one-token step (DecodeOne) over the cache's shapes into the cache directory, the file moved into place
    whole (a process killed while compiling leaves nothing half-written), and return it. Where that directory can't
    be written, the package goes to a temporary directory for this process alone, with one line. A machine with no
    working C++ compiler, or a compiler that fails on the step, is a UserError: one line, before the export where
    there is no compiler at all."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    directory = packages_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryDirectory(dir=directory, prefix=".compiling-").cleanup()
    except OSError as e:
        directory = Path(tempfile.mkdtemp(prefix="quillgpt-decode-"))
        atexit.register(shutil.rmtree, directory, True)
        print(
            f"[--compile: nothing kept, {packages_dir()} can't be written ({e.strerror or e}): the step is compiled "
            "for this run alone]",
            file=sys.stderr,
            flush=True,
        )
    try:
        get_cpp_compiler()
        return build_package(model, cache, directory, key)
    except InvalidCxxCompiler:
        raise UserError(
            "--compile needs a working C++ compiler (g++ or clang++, or $CXX): install one, or decode eagerly "
            "with --no-compile"
        ) from None
    except CppCompileError as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise UserError(
            f"--compile: the C++ compiler failed on the decoding step ({first}); --no-compile decodes eagerly"
        ) from None


def build_package(model: nn.Module, cache, directory: Path, key: str) -> Path:
    """compile_package's work: torch.export, then AOTInductor into a temporary package moved into place under the
    name that carries its digest (package_name)."""
    token = torch.zeros((1, 1), dtype=torch.long, device=cache.device)
    position = torch.zeros(1, dtype=torch.long, device=token.device)
    row = Row0(cache)
    with torch.no_grad():
        exported = torch.export.export(DecodeOne(model, row.k, row.v, row.ids), (token, position), strict=False)
    # torch's own deprecation notice from inside the packaging (pytree's LeafSpec), not the user's to act on
    with tempfile.TemporaryDirectory(dir=directory, prefix=".compiling-") as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        built = torch._inductor.aoti_compile_and_package(
            exported,
            package_path=os.path.join(tmp, "step.pt2"),
            inductor_configs={
                "aot_inductor.package_constants_in_so": False,  # bind gives each model's weights
                "cpp.vec_isa_ok": True if compiler_takes_the_cpus_isas() else None,
                **(SPLIT_STEP_CONFIGS if splits(model) else {}),
            },
        )
        with open(built, "rb") as f:
            os.fsync(f.fileno())
        path = directory / package_name(key, cache.length, sha256_file(Path(built)))
        os.replace(built, path)  # the same directory's file system: the package appears whole or not at all
    fsync_dir(directory)
    _verified.add(path)
    return path


def compiler_takes_the_cpus_isas() -> bool:
    """Whether inductor's C++ compiler takes the flags of every vector ISA this x86 CPU has (it compiles nothing with
    all of them, in a few milliseconds). Then the CPU's flags alone pick the kernels' instructions, and inductor's
    own probes are skipped: they build and load a test program per ISA, about half of a first compile on 2 cores
    (docs/sampling.md). Where the compiler refuses one (an old one, a new CPU) or this is not an x86 CPU, inductor
    probes as usual."""
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.cpp_builder import get_cpp_compiler

        if platform.machine() not in ("x86_64", "AMD64"):
            return False
        cpu = cpu_vec_isa.x86_isa_checker()
        # the ISAs inductor would probe: those whose every CPU flag this CPU reports (its valid_vec_isa_list's filter)
        isas = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in cpu for f in str(isa).split())]
        flags = [flag for isa in isas for flag in isa.build_arch_flags().split()]
        cmd = [get_cpp_compiler(), *flags, "-fsyntax-only", "-x", "c++", "-"]
        return subprocess.run(cmd, input=b"", capture_output=True, timeout=60).returncode == 0
    except (AttributeError, ImportError, OSError, subprocess.TimeoutExpired):  # another torch's internals, no compiler
        return False
