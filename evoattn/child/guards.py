"""Integrity guards installed in the child before the candidate is imported.

Each guard records what it saw into a `Violations` list instead of trusting
the candidate to let an exception escape: a candidate that catches our
PermissionError is still caught. See SECURITY.md for the threat model.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
from typing import Any, Callable

from ..contract.types import Verdict

# Library attention a kernel-only candidate may not use (class 5). Matched on source text.
_LIBRARY_PATTERNS = [
    (r"scaled_dot_product_attention", "torch scaled_dot_product_attention"),
    (r"_scaled_dot_product_\w+", "torch SDPA backend op"),
    (r"_flash_attention_forward|_efficient_attention_forward", "torch attention backend op"),
    (r"\bflash_attn\b|flash_attn_func|flash_attn_interface", "flash-attn"),
    (r"\bxformers\b", "xformers"),
    (r"cudnn\w*(sdpa|attention|fmha|mha)|cudnnMultiHeadAttn|cudnn_frontend|cudnn\.h",
     "cuDNN attention"),
    (r"torch\.backends\.cuda\.(enable_|sdp_kernel)|sdpa_kernel|SDPBackend", "SDPA backend selection"),
    (r"\bmulti_head_attention_forward\b|nn\.MultiheadAttention", "torch MultiheadAttention"),
    (r"at::_?scaled_dot_product|at::_fused_sdp|at::native::\w*attention", "ATen attention op"),
]
_BLOCKED_MODULES = ("flash_attn", "xformers", "flash_attn_interface", "cudnn")

# GPU kernel names that betray a library attention kernel in a profiled call (GPU only).
LIBRARY_KERNEL_RE = re.compile(r"cudnn|fmha|pytorch_flash|flash_fwd|efficient_attention|"
                               r"xformers|cutlassF", re.IGNORECASE)


def strip_comments(source: str) -> str:
    """Returns the source without comments and docstrings (Python) or // and /* */ (CUDA)."""
    import ast
    import io
    import tokenize
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return re.sub(r"/\*.*?\*/|//[^\n]*", "", source, flags=re.S)
    docs = []          # (start, end) of each docstring: only its string tokens are dropped,
    for node in ast.walk(tree):     # not code that shares a line with it
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(getattr(body[0], "value", None), ast.Constant) and \
                isinstance(body[0].value.value, str):
            doc = body[0]
            docs.append(((doc.lineno, doc.col_offset),
                         (doc.end_lineno or doc.lineno, doc.end_col_offset or 0)))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and any(
                a <= tok.start and tok.end <= b for a, b in docs)):
            continue
        out.append(tok)
    return tokenize.untokenize(out)


def scan_source(source: str) -> list[str]:
    """Returns the library-attention uses found in candidate code (comments and docstrings aside)."""
    found = []
    source = strip_comments(source)
    for pat, what in _LIBRARY_PATTERNS:
        m = re.search(pat, source)
        if m:
            line = source.count("\n", 0, m.start()) + 1
            found.append(f"{what} ({m.group(0)!r} at line {line})")
    return found


@dataclasses.dataclass
class Violations:
    """What the guards saw; the worker turns the first one into the verdict."""

    items: list[tuple[Verdict, str]] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, verdict: Verdict, reason: str) -> None:
        with self.lock:
            if (verdict, reason) not in self.items:
                self.items.append((verdict, reason))

    def first(self) -> tuple[Verdict, str] | None:
        with self.lock:
            return self.items[0] if self.items else None


class LibraryGuard:
    """Tripwires on torch's attention entry points, armed only while candidate code runs.

    Disarmed, they call the original (the harness's own baseline uses them).
    """

    def __init__(self, violations: Violations) -> None:
        self.violations = violations
        self.armed = 0

    def arm(self) -> None:
        self.armed += 1

    def disarm(self) -> None:
        self.armed -= 1


def install_library_guard(violations: Violations) -> LibraryGuard:
    """Replaces torch's attention entry points with tripwires; returns the guard to arm."""
    import torch
    import torch.nn.functional as F

    guard = LibraryGuard(violations)

    def wire(original: Any, what: str) -> Any:
        def tripwire(*args: Any, **kwargs: Any) -> Any:
            if guard.armed <= 0:
                return original(*args, **kwargs)
            violations.add(Verdict.POLICY, f"called {what} (library attention is not allowed "
                                           "under the kernel-only policy)")
            raise RuntimeError("evoattn: library attention is not allowed (policy kernel-only)")
        return tripwire

    F.scaled_dot_product_attention = wire(F.scaled_dot_product_attention,
                                          "torch scaled_dot_product_attention")
    torch._C._nn.scaled_dot_product_attention = wire(
        torch._C._nn.scaled_dot_product_attention, "torch scaled_dot_product_attention")
    for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
               "_efficient_attention_forward", "scaled_dot_product_attention",
               "_scaled_dot_product_attention_math"):
        for ns in (torch,):  # torch.ops.aten packets stay: torch internals need them
            orig = getattr(ns, op, None)
            if orig is not None:
                try:
                    setattr(ns, op, wire(orig, f"{op}"))
                except (AttributeError, TypeError):
                    pass

    class _Blocker:
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
            if name.split(".")[0] in _BLOCKED_MODULES:
                violations.add(Verdict.POLICY, f"imported {name} (library attention)")
                raise ImportError(f"evoattn: importing {name} is not allowed (policy kernel-only)")
            return None

    sys.meta_path.insert(0, _Blocker())
    return guard


class DispatchWatch:
    """A TorchDispatchMode that records attention ops reaching the dispatcher (correctness calls)."""

    _OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")

    def __init__(self, violations: Violations) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
                name = str(func)
                if any(s in name for s in outer._OPS):
                    violations.add(Verdict.POLICY, f"dispatched library attention op {name}")
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()

    def __enter__(self) -> "DispatchWatch":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


# Executables Triton and our build legitimately spawn while compiling.
_ALLOWED_EXES = {"ptxas", "cc", "gcc", "g++", "clang", "clang++", "ld", "ldconfig", "cuobjdump",
                 "nvdisasm", "nvlink", "fatbinary", "nvcc", "c++", "x86_64-linux-gnu-gcc"}
_STDLIB = os.path.dirname(os.__file__) + "/"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# Audit events that change the file system at path arguments (index of each path checked).
_PATH_EVENTS = {"os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,), "os.remove": (0,),
                "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
                "os.utime": (0,), "os.truncate": (0,), "shutil.rmtree": (0,),
                "shutil.copyfile": (1,), "shutil.move": (0, 1)}
# libc symbols that spawn processes or touch files behind the audit hook, looked up via ctypes.
_NATIVE_DENY = {"system", "popen", "fork", "vfork", "clone", "clone3", "syscall", "execv",
                "execve", "execvp", "execvpe", "execl", "execlp", "execle", "fexecve",
                "posix_spawn", "posix_spawnp", "open", "open64", "openat", "openat64", "creat",
                "fopen", "fopen64", "rename", "unlink", "unlinkat", "mkdir", "socket"}


def spawned_by_candidate(candidate_roots: list[str]) -> bool:
    """Returns True when the code asking to spawn is the candidate's, not a library's.

    Walks out from the caller past the standard library, this module and exec'd code
    ('<string>' frames); the first real frame decides. Triton and torch spawn ptxas,
    cc, file, ldconfig ... from their own files; a candidate's own call comes from its
    directory.
    """
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith("<") or name == __file__ or _is_stdlib(name):
            f = f.f_back
            continue
        real = os.path.realpath(name)
        return any(real.startswith(r.rstrip("/") + "/") for r in candidate_roots)
    return False


def _is_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and "-packages" not in filename


def install_sandbox(violations: Violations, allowed_dirs: list[str]) -> None:
    """Adds an audit hook: writes outside allowed_dirs, spawning programs, sockets, other /proc.

    allowed_dirs[0] is the candidate's own directory: code from there is the candidate's.
    """
    roots = [os.path.realpath(d) for d in allowed_dirs] + ["/dev/null", "/dev/shm"]
    candidate_roots = roots[:1]
    own = {f"/proc/{os.getpid()}", "/proc/self", "/proc/thread-self"}

    def allowed_write(path: str) -> bool:
        real = os.path.realpath(path)
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)

    def deny(reason: str) -> None:
        violations.add(Verdict.SANDBOX, reason)
        raise PermissionError(f"evoattn sandbox: {reason}")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            if not isinstance(path, (str, bytes)):
                return
            p = os.fsdecode(path)
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                      (isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing and not allowed_write(p):
                deny(f"wrote outside its directory: {p}")
            real = os.path.realpath(p)         # /proc/self/../<ppid>/environ is not "self"
            if real.startswith("/proc/") and not any(real == o or real.startswith(o + "/")
                                                     for o in own):
                parts = real.split("/")
                if len(parts) > 2 and parts[2].isdigit():
                    deny(f"read another process's {p}")
        elif event in _PATH_EVENTS:
            if event == "os.mkdir" and args and isinstance(args[0], (str, bytes)) and \
                    os.path.isdir(os.fsdecode(args[0])):
                return                  # makedirs(existing, exist_ok=True) changes nothing
            for i in _PATH_EVENTS[event]:
                if i < len(args) and isinstance(args[i], (str, bytes)) and \
                        not allowed_write(os.fsdecode(args[i])):
                    deny(f"changed files outside its directory ({event} {os.fsdecode(args[i])})")
        elif event == "ctypes.dlsym" and len(args) > 1 and args[1] in _NATIVE_DENY:
            deny(f"looked up native {args[1]}() through ctypes (bypasses the sandbox)")
        elif event in ("gc.get_objects", "gc.get_referrers", "gc.get_referents"):
            deny(f"inspected the garbage collector ({event}): harness state is off limits")
        elif event in ("subprocess.Popen", "os.posix_spawn", "os.exec"):
            exe = args[0]
            if isinstance(exe, (list, tuple)):
                exe = exe[0] if exe else ""
            name = os.path.basename(os.fsdecode(exe)) if exe else ""
            if not name:
                argv = args[1] if len(args) > 1 else ""
                if isinstance(argv, (list, tuple)) and argv:
                    name = os.path.basename(os.fsdecode(argv[0]))
            if name not in _ALLOWED_EXES and spawned_by_candidate(candidate_roots):
                deny(f"spawned a process: {name or exe!r}")
        elif event in ("os.system", "os.fork", "os.forkpty", "pty.spawn"):
            if spawned_by_candidate(candidate_roots):
                deny(f"spawned a process ({event})")
        elif event in ("socket.connect", "socket.sendto", "socket.sendmsg", "socket.bind"):
            deny(f"used the network ({event})")
        elif event in ("os.putenv", "os.unsetenv"):
            pass

    sys.addaudithook(hook)
    _wrap_fork_exec(deny, candidate_roots)


def _wrap_fork_exec(deny: Callable[[str], None], candidate_roots: list[str]) -> None:
    """Guards _posixsubprocess.fork_exec, which spawns without the subprocess.Popen audit event.

    subprocess binds its own reference at import, so its (audited) path is unaffected.
    """
    try:
        import _posixsubprocess
    except ImportError:
        return
    original = _posixsubprocess.fork_exec

    def fork_exec(args: Any, *rest: Any) -> Any:
        exe = os.path.basename(os.fsdecode(args[0])) if args else ""
        if exe not in _ALLOWED_EXES and spawned_by_candidate(candidate_roots):
            deny(f"spawned a process: {exe!r} (_posixsubprocess.fork_exec)")
        return original(args, *rest)

    _posixsubprocess.fork_exec = fork_exec


def candidate_threads(root: str) -> list[str]:
    """Returns names of live threads whose current stack runs code from the candidate's
    directory `root` (its main file and companions)."""
    frames = sys._current_frames()
    me = threading.get_ident()
    prefix = os.path.realpath(root).rstrip("/") + "/"

    def ours(filename: str) -> bool:
        return os.path.realpath(filename).startswith(prefix)

    found = []
    for t in threading.enumerate():
        if t.ident == me or t.ident not in frames:
            continue
        f = frames[t.ident]
        while f is not None:
            if ours(f.f_code.co_filename):
                found.append(t.name)
                break
            f = f.f_back
        target = getattr(t, "_target", None)
        code = getattr(target, "__code__", None)
        if t.name not in found and code and ours(code.co_filename):
            found.append(t.name)
    return found


def native_thread_count() -> int:
    """Returns the number of OS threads of this process."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()

