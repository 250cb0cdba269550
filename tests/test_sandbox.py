"""quillgpt/sandbox.py: hostile programs (a fork bomb, shell commands, ctypes, memory and output floods, endless
loops, writes outside the sandbox, the parent's secrets, the network, processes left running) each come back as an
Outcome that did not pass, within their limit, with nothing of theirs left running and nothing written outside their
directory; the OS layers (uid, rlimits, network namespace) hold on their own with the audit hook left out."""

import dataclasses
import json
import os
import select
import socket
import uuid

import pytest

from quillgpt.sandbox import MARKER, Limits, _run, run_python

ROOT = os.geteuid() == 0
as_root = pytest.mark.skipif(not ROOT, reason="the uid drop and the uid sweep are root's layers")
# Every hostile program first prints its session and uid, so that the test can look for what it left running.
IDS = "import os; print('ids', os.getsid(0), os.getuid(), flush=True)\n"
SECRET = "QUILLGPT_TEST_SECRET"


def alive(sid: int, uid: int) -> list[int]:
    """Live (not zombie) processes in the session `sid` or, for a uid of the sandbox's own, of that uid."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state, _, _, session = f.read().rsplit(b")", 1)[1].split()[:4]
            with open(f"/proc/{pid}/status", "rb") as f:
                real_uid = int(next(line for line in f if line.startswith(b"Uid:")).split()[1])
        except (OSError, StopIteration):
            continue  # it ended while we looked
        if state != b"Z" and (int(session) == sid or (uid != os.getuid() and real_uid == uid)):
            found.append(int(pid))
    return found


def ids(outcome) -> tuple[int, int]:
    first = outcome.stdout.splitlines()[0].split()
    assert first[0] == "ids", outcome
    return int(first[1]), int(first[2])


@pytest.fixture
def places(tmp_path):
    """Where a hostile program aims: a file under pytest's tmp_path, one in the world-writable /tmp (which the
    sandbox's uid could write to but for the audit hook) and a port a server listens on."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    outside = tmp_path / "escaped.txt"
    in_tmp = f"/tmp/quillgpt-sandbox-test-{uuid.uuid4().hex}"
    yield {"OUTSIDE": outside, "IN_TMP": in_tmp, "PORT": server.getsockname()[1], "DIR": tmp_path, "server": server}
    server.close()
    if os.path.exists(in_tmp):
        os.unlink(in_tmp)


def fill(program: str, places: dict) -> str:
    for name in ("OUTSIDE", "IN_TMP", "PORT", "DIR"):
        program = program.replace(name, repr(str(places[name])) if name != "PORT" else str(places[name]))
    return IDS + program


LEFT_RUNNING = "import os, time\nif os.fork() == 0:\n    if os.fork() == 0:\n        SETSID\n        time.sleep(60)\n"
LEFT_RUNNING += "    os._exit(0)\nprint('done', flush=True)\n"

HOSTILE = [
    pytest.param("while True: os.fork()", Limits(seconds=5), "refused", id="fork-bomb"),
    pytest.param("os.system('touch ' + IN_TMP)", Limits(), "refused", id="os.system"),
    pytest.param("import subprocess\nsubprocess.run(['touch', IN_TMP])", Limits(), "refused", id="subprocess.run"),
    pytest.param("import ctypes\nctypes.CDLL(None).system(('touch ' + IN_TMP).encode())", Limits(), "refused", id="ctypes-system"),
    pytest.param("x = bytearray(10**10)", Limits(memory_bytes=256 << 20), "memory", id="bytearray-10GB"),
    pytest.param("x = []\nwhile True: x.append(' ' * 10**6)", Limits(seconds=10, memory_bytes=256 << 20), "memory", id="growing-list"),
    pytest.param("while True: pass", Limits(seconds=1), "timeout", id="infinite-loop"),
    pytest.param("import time\ntime.sleep(60)", Limits(seconds=1), "timeout", id="sleep"),
    pytest.param("while True: print('x' * 1000)", Limits(seconds=10), "output", id="infinite-output"),
    pytest.param("open(OUTSIDE, 'w').write('x')", Limits(), "refused", id="write-outside"),
    pytest.param("open(IN_TMP, 'w').write('x')", Limits(), "refused", id="write-world-writable-tmp"),
    pytest.param("import os\nos.symlink(DIR, 'link')\nopen('link/escaped.txt', 'w')", Limits(), "refused", id="symlink-out"),
    pytest.param("fd = os.open('/tmp', os.O_RDONLY)\nos.open(os.path.basename(IN_TMP), os.O_WRONLY | os.O_CREAT, dir_fd=fd)", Limits(), "refused", id="dir-fd-out"),
    pytest.param(
        "import os, builtins, posixpath\nposixpath.realpath = os.path.realpath = lambda p: os.getcwd()\n"
        "builtins.isinstance = lambda *a: True\nclass S(str):\n    def startswith(self, *a):\n        return True\n"
        "open(S(OUTSIDE), 'w')",
        Limits(), "refused", id="patched-helpers",
    ),
    pytest.param(f"print(os.environ['{SECRET}'])", Limits(), "failed", id="secret-env-var"),
    pytest.param("print(open(f'/proc/{os.getppid()}/environ').read())", Limits(), "refused", id="parent-environ"),
    pytest.param("import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=2)", Limits(), "refused", id="socket-to-server"),
    pytest.param("try:\n    os.system('true')\nexcept BaseException:\n    pass\nprint('went on')", Limits(), "refused", id="refusal-caught"),
    pytest.param("os.kill(-1, 9)", Limits(), "refused", id="kill-everyone"),
    pytest.param(LEFT_RUNNING.replace("SETSID", "pass"), Limits(), "refused", id="left-running"),
    pytest.param(LEFT_RUNNING.replace("SETSID", "pass"), Limits(processes=2), "killed", id="left-running-processes-2"),
    pytest.param(LEFT_RUNNING.replace("SETSID", "os.setsid()"), Limits(processes=2), "killed", id="left-running-own-session", marks=as_root),
]  # fmt: skip


@pytest.mark.parametrize("program, limits, status", HOSTILE)
def test_a_hostile_program_fails_within_its_limit_and_leaves_nothing(program, limits, status, places, monkeypatch):
    monkeypatch.setenv(SECRET, "hunter2")
    outcome = run_python(fill(program, places), limits)
    assert outcome.status == status, outcome
    assert not outcome.passed
    assert outcome.seconds < limits.seconds + 2, outcome  # 2 s for a loaded machine's start-up and clean-up
    assert alive(*ids(outcome)) == [], "left running"
    assert not places["OUTSIDE"].exists() and not os.path.exists(places["IN_TMP"])
    assert "hunter2" not in outcome.stdout + outcome.stderr
    assert select.select([places["server"]], [], [], 0)[0] == [], "the server got a connection"
    assert len(outcome.stdout) + len(outcome.stderr) <= limits.output_bytes
    if status == "refused":
        assert MARKER in outcome.stderr and "went on" not in outcome.stdout


def test_a_passing_program_runs_in_a_clean_directory_of_its_own_that_is_removed(monkeypatch):
    monkeypatch.setenv(SECRET, "hunter2")
    program = (
        "import os, sys, json\nopen('out.txt', 'w').write('written')\nos.mkdir('sub')\n"
        "text = 'é'.encode('cp1252').decode('latin-1') + 'bücher.de'.encode('idna').decode()\n"  # encodings' modules
        "print(json.dumps([os.getcwd(), open('out.txt').read(), input(), dict(os.environ), sys.flags.isolated, text]))\n"
    )
    outcome = run_python(program, stdin="the input\n")
    assert (outcome.status, outcome.returncode, outcome.stderr) == ("passed", 0, ""), outcome
    assert outcome.passed
    cwd, written, given, env, isolated, text = json.loads(outcome.stdout)
    assert (written, given, isolated, text) == ("written", "the input", 1, "éxn--bcher-kva.de")
    assert env == {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd, "TMPDIR": cwd}
    assert not os.path.exists(cwd)


def test_a_failing_assertion_fails_with_its_traceback():
    outcome = run_python("def add(a, b):\n    return a - b\n\nassert add(2, 2) == 4\n")
    assert (outcome.status, outcome.returncode) == ("failed", 1), outcome
    assert "assert add(2, 2) == 4" in outcome.stderr and "AssertionError" in outcome.stderr


def test_the_child_has_a_network_namespace_of_its_own():
    outcome = run_python("print(open('/proc/net/dev').read())")
    assert outcome.passed, outcome
    interfaces = {line.split(":")[0].strip() for line in outcome.stdout.splitlines()[2:] if line.strip()}
    assert interfaces == {"lo"}


@as_root
def test_as_root_the_program_runs_as_a_uid_of_its_own():
    first, second = (run_python("import os; print(os.getuid(), os.getgid(), os.getgroups())") for _ in range(2))
    assert first.passed and second.passed, (first, second)
    assert first.stdout.split()[0] not in ("0", second.stdout.split()[0])


# The OS layers alone (_run(audit=False)): what a program that got past the audit hook would meet. As root only,
# where the dropped uid and RLIMIT_NPROC hold; os.system's failure to fork is not an exception, hence the asserts.
OS_LAYERS = [
    pytest.param("while True: os.fork()", Limits(seconds=5, processes=3), id="fork-bomb-held-by-nproc"),
    pytest.param("assert os.system('touch ' + IN_TMP) == 0", Limits(), id="os.system-cannot-fork"),
    pytest.param("open(OUTSIDE, 'w').write('x')", Limits(), id="write-outside-denied-to-the-uid"),
    pytest.param("import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=2)", Limits(), id="no-network"),
    pytest.param("print(open(f'/proc/{os.getppid()}/environ').read())", Limits(), id="parent-environ-denied"),
    pytest.param("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", Limits(), id="rlimits-cannot-be-raised"),
]  # fmt: skip


@as_root
@pytest.mark.parametrize("program, limits", OS_LAYERS)
def test_the_os_layers_hold_without_the_audit_hook(program, limits, places):
    outcome = _run(fill(program, places), limits, "", audit=False)
    assert outcome.status in ("failed", "killed"), outcome  # killed: the fork bomb's processes outlived its start
    assert alive(*ids(outcome)) == [], "left running"
    assert not places["OUTSIDE"].exists() and not os.path.exists(places["IN_TMP"])
    assert select.select([places["server"]], [], [], 0)[0] == [], "the server got a connection"


@as_root
def test_what_the_uid_leaves_in_world_writable_directories_is_removed(places):
    # os.mkfifo raises no audit event: the fifo is made, and swept away after the run
    outcome = run_python(fill("os.mkfifo(IN_TMP)\nprint(os.path.exists(IN_TMP))", places))
    assert outcome.passed and outcome.stdout.endswith("True\n"), outcome
    assert not os.path.exists(places["IN_TMP"])


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        Limits(seconds=0)
    with pytest.raises(ValueError, match="positive"):
        Limits(processes=-1)


NOT_ROOT_RUNNER = """
import json, os, sys, time
from quillgpt.sandbox import Limits, run_python
assert os.geteuid() != 0
out = []
for program, limits in json.load(sys.stdin):
    started = time.monotonic()
    outcome = run_python(program, Limits(**limits))
    out.append([outcome.status, time.monotonic() - started, outcome.stdout])
print(json.dumps(out))
"""


def test_without_root_each_hostile_program_fails_within_its_limit_and_leaves_nothing(places, tmp_path):
    """The path a user who is not root takes (no uid of its own; a user namespace for the network): the whole hostile
    table run from a user namespace whose euid is not 0, as `unshare --user` gives one. The root-only case (a
    setsid() grandchild, which only the uid sweep finds) is left out: docs/evaluation.md says so."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(["unshare", "--user", "true"]).returncode != 0:
        pytest.skip("no unprivileged user namespace here (unshare --user)")
    cases = [p.values for p in HOSTILE if not p.marks]
    given = [[fill(program, places), dataclasses.asdict(limits)] for program, limits, _ in cases]
    env = {**os.environ, SECRET: "hunter2", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        ["unshare", "--user", sys.executable, "-c", NOT_ROOT_RUNNER],
        input=json.dumps(given), capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    for (program, limits, status), (got, seconds, stdout) in zip(cases, json.loads(done.stdout), strict=True):
        assert got == status, (program, got, stdout)
        assert seconds < limits.seconds + 2, program
        assert "hunter2" not in stdout
        if stdout.startswith("ids"):
            sid = int(stdout.split()[1])
            assert alive(sid, os.getuid()) == [], f"left running: {program}"
    assert not places["OUTSIDE"].exists() and not os.path.exists(places["IN_TMP"])
    assert select.select([places["server"]], [], [], 0)[0] == [], "the server got a connection"
