"""The test suite: every implementation against the others and against outside references.

    python test_parity.py                 # everything (CPU: 6 to 12 minutes on 2 cores, 2 workers)
    python test_parity.py --quick         # the quick tier: every script once, each GPT-2 trainer with
                                          # each recipe (CPU: 1.5 to 5 minutes on 2 cores; -m quick)
    python test_parity.py -k tokenizer    # a selection (pytest -k syntax; with --quick, of the quick tier)
    python test_parity.py --list          # what each test checks, grouped by component
    pytest                                # the same tests under plain pytest

Component tests live in tests/test_<component>.py, the tests every GPT-2 trainer passes (a training run,
resume, bad input) in tests/test_trainers.py, the cross-framework checks in tests/test_cross.py,
the shared fixtures (test data, tiny shards and model files, a local HTTP server) in tests/conftest.py.
The quick tier is the tests marked @pytest.mark.quick: one that runs each GPT-2 trainer with each recipe
(Triton's trainer with backend torch and with backend triton), and one for every other script.
Without a CUDA GPU, Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1 is set before triton is
imported) and JAX and torch run on the CPU; with one, the compiled kernels are also checked in bf16. The
test data is committed under tests/data (its README.md lists every file), so a bare clone runs every test
offline; tiktoken reads GPT-2's files from there too, through a temporary cache.
"""
import atexit
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(REPO, "tests", "data")

# tiktoken's "gpt2" encoding reads these two files through its cache, each under the sha1 of its URL
# (tiktoken_ext/openai_public.py; tests/test_fixtures.py checks the URLs and pinned hashes against it)
TIKTOKEN_GPT2_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe": "gpt2/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json": "gpt2/encoder.json",
}
TIKTOKEN_CACHE_PREFIX = "gpt2-tests-tiktoken-"


def has_cuda_gpu():
    """True when an NVIDIA GPU is visible; decided without importing torch, jax or triton."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def tiktoken_cache():
    """A temporary tiktoken cache holding the committed GPT-2 files under the names tiktoken looks for,
    removed when this process exits. tiktoken then never touches the network or a cache of the user's."""
    cache = tempfile.mkdtemp(prefix=TIKTOKEN_CACHE_PREFIX)
    atexit.register(shutil.rmtree, cache, True)
    for url, rel in TIKTOKEN_GPT2_FILES.items():
        shutil.copyfile(os.path.join(DATA, rel), os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()))
    return cache


def configure_environment():
    """Must run before triton is imported anywhere in the test process (and is inherited by the scripts
    the tests start): the Triton interpreter without a GPU, tiktoken's cache built from tests/data, no
    JAX memory grab, one torch thread a process unless the caller sets OMP_NUM_THREADS (the tiny models
    gain nothing from more, and two workers' threads would otherwise contend for the cores). Running it
    again (conftest imports this module) keeps the cache it made."""
    if "TRITON_INTERPRET" not in os.environ and not has_cuda_gpu():
        os.environ["TRITON_INTERPRET"] = "1"
    cache = os.environ.get("TIKTOKEN_CACHE_DIR", "")
    if not (os.path.basename(cache).startswith(TIKTOKEN_CACHE_PREFIX) and os.path.isdir(cache)):
        os.environ["TIKTOKEN_CACHE_DIR"] = tiktoken_cache()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


configure_environment()


class _ListTests:
    """pytest plugin behind --list: prints each collected test's docstring, grouped by component."""

    def pytest_collection_finish(self, session):
        groups = {}
        for item in session.items:
            module = item.module
            title = (module.__doc__ or module.__name__).strip().splitlines()[0]
            doc = (getattr(item.function, "__doc__", None) or "").strip().splitlines()
            groups.setdefault(title, []).append((item.name, doc[0] if doc else ""))
        for title, tests in groups.items():
            print(f"\n{title}")
            for name, doc in tests:
                print(f"  {name:<48} {doc}")
        print(f"\n{len(session.items)} tests")


def main(argv):
    args = list(argv)
    if {"-h", "--help"} & set(args):  # this script's own options; pytest's would bury them under 400 lines
        print(__doc__.split("\n\n")[1] + "\n\nAny other option is pytest's: python -m pytest --help lists them.")
        return 0
    import pytest
    listing = "--list" in args
    if listing:
        args.remove("--list")
    if "--quick" in args:  # the quick tier, or the part of it that a -m of the command line selects
        args.remove("--quick")
        if "-m" in args[:-1]:
            at = args.index("-m") + 1
            args[at] = f"quick and ({args[at]})"
        else:
            args += ["-m", "quick"]
    targets = [os.path.join(REPO, "tests")]
    if listing:
        return pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", *targets, *args],
                           plugins=[_ListTests()])
    return pytest.main(["-p", "no:cacheprovider", "--durations=15", *parallel(args), *targets, *args])


def parallel(args):
    """pytest-xdist's flags for two worker processes, one test file at a time each (a file's module-scoped
    runs then happen once), unless the command line chooses (-n, -p no:xdist) or xdist is missing. Most
    tests spend their time in one single-threaded process or compile, so two workers use the two cores
    of a small machine that one leaves half idle."""
    if importlib.util.find_spec("xdist") is None:  # found, not imported: pytest imports its plugins itself
        return []
    if any(a.startswith(("-n", "--numprocesses")) or "xdist" in a for a in args):
        return []
    return ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]  # conftest's order: the longest first


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
