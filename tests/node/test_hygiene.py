"""Process hygiene (node/hygiene.py) and the log privacy filter (node/log_privacy.py).

`apply_hygiene` changes the process for good (limits, dumpability, locked memory), so it runs in a
subprocess; so does the leak attempt, which installs the filter the way the node does, after basicConfig.
"""

from __future__ import annotations

import ast
import ctypes
import json
import mmap
import resource
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from node.hygiene import (
    CAP_IPC_LOCK,
    LOCK_ALL,
    HygienePolicy,
    HygieneState,
    exclude_from_dumps,
    lock_region,
    parse_swaps,
)
from policies.node_policy import NodePolicy, NodePolicyError, NodeRequirements, load_node_policy

ROOT = Path(__file__).resolve().parents[2]
LINUX = pytest.mark.skipif(sys.platform != "linux", reason="prctl, mlockall, madvise and /proc are Linux's")
PR_CAPBSET_DROP = 24
REPORT = """
import ctypes, json, resource
from node.hygiene import apply_hygiene
state = apply_hygiene()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"state": state.as_json(), "core": resource.getrlimit(resource.RLIMIT_CORE),
                  "dumpable": ctypes.CDLL(None).prctl(3, 0, 0, 0, 0),
                  "locked_kib": int(status["VmLck"].split()[0]), "cap_eff": int(status["CapEff"], 16)}))
"""


def run_python(script: str, preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            preexec_fn=preexec_fn)
    assert result.returncode == 0, result.stderr
    return result


def report(preexec_fn: Callable[[], None] | None = None) -> dict[str, Any]:
    return dict(json.loads(run_python(REPORT, preexec_fn).stdout))


def can_lock_everything() -> bool:
    cap_eff = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff"))
    holds_cap = bool(int(cap_eff.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return holds_cap or resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY


@LINUX
def test_apply_hygiene_turns_core_dumps_off_makes_the_process_undumpable_and_lists_swap() -> None:
    seen = report()
    state = seen["state"]
    assert seen["core"] == [0, 0] and state["core_dumps_off"] is True
    assert seen["dumpable"] == 0 and state["dumpable"] is False
    swaps = Path("/proc/swaps").read_text().splitlines()[1:]
    assert state["swap_active"] == [line.split()[0].replace("\\040", " ") for line in swaps]
    assert state["dump_exclusion"] is True
    if can_lock_everything():
        assert (state["memory_locked"], state["memory_lock_reason"]) == (True, LOCK_ALL)
        assert seen["locked_kib"] > 0
    else:
        assert state["memory_locked"] is False and seen["locked_kib"] == 0
        assert state["memory_lock_reason"].startswith("RLIMIT_MEMLOCK is ")


def _without_cap_ipc_lock() -> None:
    """In the child before exec: a 64 KiB lock limit, and CAP_IPC_LOCK out of the bounding set (root's
    capabilities are recomputed from it at exec)."""
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, 64 * 1024))
    ctypes.CDLL(None).prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0)


@LINUX
def test_under_a_finite_lock_limit_without_cap_ipc_lock_memory_is_not_locked_and_the_reason_says_why() -> None:
    seen = report(_without_cap_ipc_lock)
    if seen["cap_eff"] >> CAP_IPC_LOCK & 1:
        pytest.skip("this process may not drop CAP_IPC_LOCK from its children (no CAP_SETPCAP)")
    assert seen["state"]["memory_locked"] is False and seen["locked_kib"] == 0
    assert seen["state"]["memory_lock_reason"] == ("RLIMIT_MEMLOCK is 64 KiB and no CAP_IPC_LOCK (mlockall not "
                                                   "attempted: under MCL_FUTURE, allocations past the limit would "
                                                   "fail later)")


def test_on_another_system_only_the_core_limit_changes_and_the_state_says_so() -> None:
    script = "import sys\nsys.platform = 'darwin'\n" + REPORT
    seen = report() if sys.platform != "linux" else json.loads(run_python(script).stdout)
    assert seen["core"] == [0, 0]
    assert seen["state"] == {"core_dumps_off": True, "dumpable": True, "memory_locked": False,
                             "memory_lock_reason": "not Linux (darwin)", "swap_active": None,
                             "dump_exclusion": False, "freed_memory_overwritten": False}
    assert seen["dumpable"] == 1 and seen["locked_kib"] == 0


def test_parse_swaps_reads_names_and_unescapes_spaces() -> None:
    text = ("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
            "/dev/sda2                               partition\t8388604\t\t0\t\t-2\n"
            "/var/swap\\040file                       file\t\t1048572\t\t0\t\t-3\n")
    assert parse_swaps(text) == ("/dev/sda2", "/var/swap file")
    assert parse_swaps("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n") == ()


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping in /proc/self/smaps that holds `address`."""
    holds = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(part, 16) for part in first.split("-"))
            holds = start <= address < end
        elif holds and first == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def three_pages() -> Iterator[int]:
    """The address of three fresh anonymous pages."""
    with mmap.mmap(-1, 3 * mmap.PAGESIZE) as region:
        anchor = ctypes.c_char.from_buffer(region)
        yield ctypes.addressof(anchor)
        del anchor


def dontdump_supported() -> bool:
    with mmap.mmap(-1, mmap.PAGESIZE) as page:
        try:
            page.madvise(mmap.MADV_DONTDUMP)
        except (AttributeError, OSError):
            return False
    return True


@LINUX
def test_exclude_from_dumps_marks_only_the_whole_pages_inside_the_range(three_pages: int) -> None:
    if not dontdump_supported():
        pytest.skip("madvise(MADV_DONTDUMP) is not supported by this kernel")
    page = mmap.PAGESIZE
    assert exclude_from_dumps(three_pages + 100, 2 * page) is True  # holds page 1 whole, parts of 0 and 2
    assert ["dd" in vm_flags(three_pages + i * page) for i in range(3)] == [False, True, False]


@LINUX
def test_lock_region_locks_only_the_whole_pages_inside_the_range(three_pages: int) -> None:
    page = mmap.PAGESIZE
    assert lock_region(three_pages + 1, 2 * page) is True
    assert ["lo" in vm_flags(three_pages + i * page) for i in range(3)] == [False, True, False]


@pytest.mark.parametrize("call", [exclude_from_dumps, lock_region])
def test_a_range_without_a_whole_page_is_refused(call: Callable[[int, int], bool], three_pages: int) -> None:
    assert call(three_pages + 1, mmap.PAGESIZE) is False
    assert call(three_pages, mmap.PAGESIZE - 1) is False
    assert call(three_pages, 0) is False


def test_the_shipped_policies_load_as_node_policies() -> None:
    confidential, standard = (HygienePolicy(load_node_policy(name)) for name in ("confidential", "standard"))
    assert (confidential.name, confidential.policy.require) == ("confidential", NodeRequirements(True, True, True,
                                                                                                  True, True))
    assert (standard.name, standard.policy.require) == ("standard", NodeRequirements(False, False, False, False,
                                                                                          False))


def write_policy(tmp_path: Path, text: str) -> str:
    path = tmp_path / "site.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


SITE = "jurisdiction: DE\ntrust_tier: standard\n"


def test_a_policy_file_by_path_loads(tmp_path: Path) -> None:
    path = write_policy(tmp_path, SITE + "require: {memory_locked: true, no_swap: false, sealing: true, "
                                         "confidential_hardware: false, tls: false}\n")
    assert HygienePolicy(load_node_policy(path)) == HygienePolicy(NodePolicy("site", "DE", "standard",
                                                                 NodeRequirements(True, False, True, False, False)))


@pytest.mark.parametrize(("text", "message"), [
    (SITE + "require: {memory_locked: true, no_swap: true, sealing: true, confidential_hardware: true, tls: true, "
            "no_dumps: true}\n",
     "unknown key(s) in 'require' of node policy 'site': no_dumps; allowed: memory_locked, no_swap, sealing, "
     "confidential_hardware, tls"),
    ("require: {memory_locked: true, no_swap: true, sealing: true}\n",
     "missing key(s) in 'policy' of node policy 'site': jurisdiction, trust_tier; every key is written out"),
    (SITE + "require: {memory_locked: true, no_swap: true, sealing: true}\n",
     "missing key(s) in 'require' of node policy 'site': confidential_hardware, tls; every key is written out"),
    (SITE + "require: {memory_locked: yes please, no_swap: true, sealing: true, confidential_hardware: true, "
            "tls: true}\n",
     "'require.memory_locked' in node policy 'site' must be true or false"),
    ("- memory_locked\n", "'policy' in node policy 'site' must be a mapping"),
])
def test_a_malformed_policy_is_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(NodePolicyError) as raised:
        HygienePolicy(load_node_policy(write_policy(tmp_path, text)))
    assert str(raised.value) == message


def test_an_unknown_policy_name_is_refused() -> None:
    with pytest.raises(NodePolicyError) as raised:
        HygienePolicy(load_node_policy("pricing"))
    assert str(raised.value) == ("no node policy 'pricing': name one of confidential, standard or give the "
                                 "path of a YAML file")


EXPOSED = HygieneState(core_dumps_off=True, dumpable=False, memory_locked=False,
                       memory_lock_reason="RLIMIT_MEMLOCK is 8 MiB and no CAP_IPC_LOCK (mlockall not attempted: "
                                          "under MCL_FUTURE, allocations past the limit would fail later)",
                       swap_active=("/dev/sda2", "/swapfile"), dump_exclusion=True)
SEALED = HygieneState(core_dumps_off=True, dumpable=False, memory_locked=True, memory_lock_reason=LOCK_ALL,
                      swap_active=(), dump_exclusion=True)


def test_missing_names_each_requirement_not_met_and_how_to_fix_it() -> None:
    assert HygienePolicy(load_node_policy("confidential")).missing(EXPOSED, sealing=False) == [
        "memory is not locked: RLIMIT_MEMLOCK is 8 MiB and no CAP_IPC_LOCK (mlockall not attempted: under "
        "MCL_FUTURE, allocations past the limit would fail later): run as root (CAP_IPC_LOCK) or raise the limit "
        "with `ulimit -l unlimited`",
        "swap is active (/dev/sda2, /swapfile): turn it off with `swapoff -a`",
        "stored prompt state is not sealed: serve without --no-seal, or with --no-reuse so that no prompt state is "
        "stored",
    ]
    unknown_swap = HygieneState(True, False, True, LOCK_ALL, None, False)
    assert HygienePolicy(load_node_policy("confidential")).missing(unknown_swap, sealing=True) == [
        "swap cannot be checked: /proc/swaps is not readable on this system"]
    assert HygienePolicy(load_node_policy("confidential")).missing(SEALED, sealing=True) == []
    assert HygienePolicy(load_node_policy("standard")).missing(EXPOSED, sealing=False) == []


def test_the_state_as_json() -> None:
    assert EXPOSED.as_json() == {"core_dumps_off": True, "dumpable": False, "memory_locked": False,
                                 "memory_lock_reason": EXPOSED.memory_lock_reason,
                                 "swap_active": ["/dev/sda2", "/swapfile"], "dump_exclusion": True,
                                 "freed_memory_overwritten": False}


MARKER = "PROMPT-TEXT-c81f0e"
FSTRING_MARKER = "FSTRING-TEXT-5d2b9a"
LEAK_ATTEMPT = f"""
import logging, sys
from node.log_privacy import Safe, install_privacy_filter
MARKER = {MARKER!r}
SECRET = {FSTRING_MARKER!r}
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
install_privacy_filter()
install_privacy_filter()
log = logging.getLogger("node.app")
log.info("prompt of %d tokens for model %s: %s", 12, Safe("tiny-model"), MARKER)
logging.getLogger("aiohttp.server").error("Error handling request: %r", MARKER.encode())
try:
    raise ValueError("cannot tokenize " + MARKER)
except ValueError:
    log.exception("completion failed in %s", Safe("/v1/chat/completions"))
try:
    try:
        raise KeyError(MARKER)
    except KeyError as inner:
        raise RuntimeError("while reading " + MARKER) from inner
except RuntimeError:
    log.exception("chained failure")
log.warning("fields %(prompt)s of %(count)d", {{"prompt": MARKER, "count": 3}})
log.warning("a whole dict: %s", {{MARKER: MARKER}})
log.info(MARKER.encode())
log.info("with a stack", stack_info=True)
log.info(f"built with an f-string: {{SECRET}}")
logging.getLogger().handlers.clear()
logging.getLogger("node.meter").error("to the last resort: %s", MARKER)
"""


def test_a_leak_attempt_writes_no_request_text_to_any_log() -> None:
    result = run_python(LEAK_ATTEMPT)
    assert MARKER not in result.stdout + result.stderr
    assert "Logging error" not in result.stderr  # a failed format prints the record's arguments
    lines = result.stdout.splitlines()
    assert lines[0] == "INFO node.app: prompt of 12 tokens for model tiny-model: <withheld>"
    assert lines[1] == "ERROR aiohttp.server: Error handling request: '<withheld>'"
    assert lines[2:6] == ["ERROR node.app: completion failed in /v1/chat/completions",
                          "Traceback (most recent call last):",
                          '  File "<string>", line 13, in <module>',
                          "ValueError: <withheld>"]
    assert lines[6:16] == ["ERROR node.app: chained failure",
                           "Traceback (most recent call last):",
                           '  File "<string>", line 18, in <module>',
                           "KeyError: <withheld>",
                           "",
                           "The above exception was the direct cause of the following exception:",
                           "",
                           "Traceback (most recent call last):",
                           '  File "<string>", line 20, in <module>',
                           "RuntimeError: <withheld>"]
    assert lines[16:] == ["WARNING node.app: fields <withheld> of 3",
                          "WARNING node.app: a whole dict: %s",  # no key of the dict is named in the format string
                          "INFO node.app: <withheld>",
                          "INFO node.app: with a stack",
                          # Beyond any filter: a message built before logging is why our code never builds one
                          # (test_our_log_calls_use_constant_format_strings).
                          f"INFO node.app: built with an f-string: {FSTRING_MARKER}"]
    assert result.stderr == "to the last resort: <withheld>\n"


LEVELS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal"}
LOGGERS = {"log", "logger", "logging"}


def logging_calls(source: str) -> list[tuple[int, bool]]:
    """(line, whether its format string is a constant) of each logging call in `source`."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        name = receiver.id if isinstance(receiver, ast.Name) else getattr(receiver, "attr", None)
        position = {**dict.fromkeys(LEVELS, 0), "log": 1}.get(node.func.attr)
        if name not in LOGGERS or position is None:
            continue
        message = node.args[position] if len(node.args) > position else None
        calls.append((node.lineno, isinstance(message, ast.Constant) and isinstance(message.value, str)))
    return sorted(calls)


def built_messages(source: str) -> list[int]:
    """Lines of logging calls whose format string is not a constant (f-string, +, %, .format, a name)."""
    return [line for line, constant in logging_calls(source) if not constant]


def test_the_scan_finds_every_way_of_building_a_message() -> None:
    source = textwrap.dedent("""
        log.info("constant %s", x)
        log.info(f"built {x}")
        self.log.warning("a" + x)
        logger.error("%s" % x)
        logging.debug("{}".format(x))
        log.log(20, message)
        log.log(20, "constant")
        math.log(x)
        log.exception(exc)
    """)
    assert built_messages(source) == [3, 4, 5, 6, 7, 10]


def test_our_log_calls_use_constant_format_strings() -> None:
    packages = ("node", "cache", "metering", "attestation", "policies", "router", "bench")
    sources = sorted(path for package in packages for path in (ROOT / package).rglob("*.py"))
    texts = {str(path.relative_to(ROOT)): path.read_text() for path in sources}
    assert sum(len(logging_calls(text)) for text in texts.values()) >= 9  # the scan sees them (9 when written)
    built = {path: built_messages(text) for path, text in texts.items()}
    assert {path: lines for path, lines in built.items() if lines} == {}


def test_the_nodes_working_buffers_are_excluded_from_dumps(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from cache.lanes import FRESH_BUFFER_HOOKS, BufferPool
    from node.hygiene import exclude_from_dumps

    if not sys.platform.startswith("linux"):
        pytest.skip("madvise(MADV_DONTDUMP) is Linux's")
    monkeypatch.setattr("cache.lanes.FRESH_BUFFER_HOOKS", [*FRESH_BUFFER_HOOKS, exclude_from_dumps])
    buffer = BufferPool().take(0, torch.empty(1), (1, 8, 4096, 64))  # 8 MiB: its own mapping, whole pages
    assert "dd" in vm_flags(buffer.data_ptr() + buffer.numel() * buffer.element_size() // 2)
