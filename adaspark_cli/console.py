"""What every command shares: one-line errors and exit codes, reading prompt text, the model
options. Commands import this module; only main.py imports the commands, so there is no loop.

Text goes to stdout, diagnostics to stderr; bad usage or bad input is one line on stderr and exit
code 2, a write that fails (a full disk) exit code 1."""

from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import orjson
import typer

from adaspark_core.base import sampling as sampling_fields
from adaspark_core.base.errors import InputError, OutputError
from adaspark_core.base.files import read_regular
from adaspark_core.base.sampling import Sampling
from adaspark_core.decode.grammar import ANY_OBJECT
from adaspark_core.engine.devices import RPC_TIMEOUT_SECONDS, DeviceLayout, parse_layout


def fail(message: str) -> None:
    typer.echo(f"adaspark: error: {message}", err=True)
    raise typer.Exit(2)


@contextmanager
def reported():
    """Turn the core's input errors into one line and exit code 2 (output errors: exit code 1);
    end quietly when the reader of stdout goes away (``| head``) or the user interrupts."""
    try:
        yield
    except InputError as e:
        fail(str(e))
    except OutputError as e:
        typer.echo(f"adaspark: error: {e}", err=True)
        raise typer.Exit(1)
    except BrokenPipeError:
        quiet_stdout()
        raise typer.Exit(0)
    except KeyboardInterrupt:
        typer.echo("", err=True)
        raise typer.Exit(130)


class Interrupted(Exception):
    """A signal arrived while the command was idle (Signals)."""


class Signals:
    """SIGINT and SIGTERM as a clean stop. While ``busy`` a signal is only noted (``got``), so a
    round and a store write are never cut in half: the work ends at its next round boundary,
    its last round marked interrupted, and saves what its log holds. While idle, Interrupted is
    raised (a blocked read must end). ``force``: a second SIGINT while busy stops at once
    (KeyboardInterrupt), the store keeping its last save, for a user who will not wait."""

    def __init__(self, force: bool = False):
        self.got: int | None = None
        self.busy = False
        self.force = force

    def __call__(self, signum, frame):
        if self.force and self.busy and self.got is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.got = signum
        if not self.busy:
            raise Interrupted

    def install(self) -> "Signals":
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)
        return self

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process a signal ended; 0 if none came."""
        return 128 + self.got if self.got is not None else 0


def run_app(app: typer.Typer, args: list[str] | None = None) -> None:
    """Run a Typer app as a command and exit with its code. Usage errors (a bad option value, an
    unknown option) are one line on stderr and exit code 2, as the core's input errors are:
    Typer's boxes are for ``--help``, not for a pipeline's log. No arguments shows the help."""
    try:
        code = app(args=args, standalone_mode=False)
    except typer.TyperException as e:  # Click's usage errors
        if type(e).__name__ == "NoArgsIsHelpError":  # the command alone: its help, as --help
            e.show()
        else:
            ctx = getattr(e, "ctx", None)
            see = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            sys.stderr.write(f"adaspark: error: {' '.join(e.format_message().split())}{see}\n")
        sys.exit(getattr(e, "exit_code", 2))
    except typer.Abort:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def quiet_stdout() -> None:
    """Point stdout at /dev/null after its reader went away, so the interpreter's final flush
    does not fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# The largest prompt file read: its text must fit a context, and 16 MB is some four million tokens
# at 4 bytes a token, past any context a model here runs with.
MAX_PROMPT_BYTES = 16 << 20


def read_prompt(path: str) -> str:
    """The prompt text of a file, or of stdin for ``-``; one error line if it cannot be read, is
    not UTF-8, or is empty."""
    if path == "-":
        if sys.stdin is None:
            fail("stdin is closed: give the prompt on stdin or name a prompt file")
        raw, what = sys.stdin.buffer.read(), "stdin"
    else:
        try:
            raw, what = read_regular(path, "the prompt file", MAX_PROMPT_BYTES), f"prompt file {path}"
        except FileNotFoundError:
            fail(f"prompt file not found: {path}")
        except InputError as e:  # a folder, a device, a FIFO, too large: named by the reader
            fail(str(e))
    text = utf8(raw, what)
    if not text.strip():
        fail(f"prompt is empty: {path}")
    return text


def utf8(raw: bytes | str, what: str) -> str:
    """``raw`` as text; one error line if it is not UTF-8 (a command-line argument that is not
    reaches Python as a str holding lone surrogates)."""
    try:
        return raw.decode("utf-8") if isinstance(raw, bytes) else raw.encode("utf-8").decode("utf-8")
    except UnicodeError:
        fail(f"{what} is not UTF-8 text")


def write_json(obj) -> None:
    """One JSON object as one line on stdout."""
    sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()


def histogram(counts: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


# --- the options that pick and load the model (decode, serve-stdin, compare) -----------------------

MODEL = typer.Option(None, "--model", "-m", help="GGUF file or a known model's name (adaspark models; default: smollm2-135m), or sim:CURVE (a simulated model).")
DRAFTER = typer.Option("none", "--drafter", help="none (n-gram candidates only), dspark:FILE (a DSpark block drafter GGUF made for the model) or model:FILE (a draft model with the model's vocabulary).")
BLOCK = typer.Option(None, "--block", min=1, help="Positions a model drafter proposes per round (B; default: a DSpark file's block size, 4 for a draft model).")
DRAFT_TOP_K = typer.Option(8, "--draft-top-k", min=1, help="Candidates a model drafter keeps per position (K).")
N_CTX = typer.Option(None, "--n-ctx", min=16, help="Context size (default: the model's, at most 8192).")
THREADS = typer.Option(None, "--threads", min=1, help="CPU threads (default: all).")
# Where the model's layers run, as llama.cpp's tools name it (engine/devices.py)
N_GPU_LAYERS = typer.Option(None, "--n-gpu-layers", help="Layers to offload from the CPU: a number or all (default: none; all once --device, --tensor-split or --rpc names devices). A build without a GPU backend keeps them on the CPU.")
DEVICE = typer.Option(None, "--device", help="Comma-separated backend devices to offload to, by llama.cpp's names (CUDA0, Vulkan0, ...; default: every one found).")
TENSOR_SPLIT = typer.Option(None, "--tensor-split", help="Comma-separated share of the offloaded layers for each device (3,1).")
RPC = typer.Option(None, "--rpc", help="Comma-separated HOST:PORT of llama.cpp RPC servers whose devices take layers too (docs/devices.md).")
RPC_TIMEOUT = typer.Option(RPC_TIMEOUT_SECONDS, "--rpc-timeout", min=0.001, help="Seconds an RPC server may take over one message, its compute included, before the run ends with an error (a server that stopped answering).")
ARM = typer.Option("adaspark", "--arm", help="adaspark, cost, pinned:N, tree:N, chain:N or ar.")
STORE = typer.Option(None, "--store", help="Learned state for the learning arms (default: one per model, drafter and machine, in the cache).")
TEMPERATURE = typer.Option(0.0, "--temperature", min=0.0, max=2.0, help="0: greedy. Above 0: sampled, with speculation that never changes the sample (draws keyed by --seed and position).")
SAMPLE_TOP_K = typer.Option(0, "--top-k", min=0, max=sampling_fields.TOP_K_MAX, help="Sampling: keep the K most likely tokens (0: all).")
TOP_P = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Sampling: keep the most likely tokens up to this mass.")
MIN_P = typer.Option(0.0, "--min-p", min=0.0, max=1.0, help="Sampling: keep tokens at least this share of the most likely one's probability.")


def seed_in_range(seed: Optional[int]) -> Optional[int]:
    """--seed's check: a round record holds a signed or unsigned 64-bit integer. (A callback, not
    min and max, whose 20-digit bounds would fill --help.)"""
    lo, hi = sampling_fields.SEED_RANGE
    if seed is not None and not lo <= seed <= hi:
        raise typer.BadParameter(f"{seed} is not a 64-bit integer")
    return seed


SEED = typer.Option(None, "--seed", callback=seed_in_range, help="Sampling: the seed (default: a random one, reported).")
MEMORY_MB = typer.Option(64.0, "--memory-mb", min=0.0, help="Cap of the n-gram memory of earlier replies, kept beside the store; 0: none.")
CHAT_TEMPLATE_FILE = typer.Option(None, "--chat-template-file",
                                  help="A Jinja chat template in place of the model's (e.g. one that takes tools).")
MAX_TEMPLATE_BYTES = 1 << 20


def chat_template(path: Optional[Path]) -> Optional[str]:
    """The text of --chat-template-file (a regular file of UTF-8 text, at most 1 MiB), or None."""
    if path is None:
        return None
    try:
        raw = read_regular(path, "the chat template file", MAX_TEMPLATE_BYTES)
    except FileNotFoundError:
        raise InputError(f"no chat template file {path}") from None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise InputError(f"the chat template file {path} is not UTF-8 text") from None


JSON_SCHEMA = typer.Option(None, "--json-schema",
                           help="Reply with JSON following this JSON Schema (a file, or {} for any object).")
MAX_SCHEMA_BYTES = 1 << 20


def json_schema(spec: Optional[str]) -> Optional[dict]:
    """--json-schema: the schema the reply follows (None: text; ``{}``: any object). A JSON object
    given inline is the schema itself; else it names a file."""
    if spec is None:
        return None
    if spec.lstrip().startswith("{"):
        raw, what = spec.encode(), "--json-schema"
    else:
        try:
            raw, what = read_regular(Path(spec), "the JSON schema file", MAX_SCHEMA_BYTES), f"the JSON schema file {spec}"
        except FileNotFoundError:
            fail(f"no JSON schema file {spec}")
        except InputError as e:  # a folder, a device, too large: named by the reader
            fail(str(e))
    try:
        schema = json.loads(raw)
    except ValueError as e:
        fail(f"{what} is not JSON: {e}")
    if not isinstance(schema, dict):
        fail(f"{what} is not a JSON object")
    return schema or ANY_OBJECT


LOG = typer.Option(None, "--log", help="Append one JSON line per round to this file (for adaspark replay).")


def layout(n_gpu_layers: Optional[str], device: Optional[str], tensor_split: Optional[str],
           rpc: Optional[str], rpc_timeout: float = RPC_TIMEOUT_SECONDS) -> DeviceLayout:
    """The device layout the options name; one error line and exit code 2 for a bad one."""
    try:
        return parse_layout(n_gpu_layers, device, tensor_split, rpc, rpc_timeout)
    except InputError as e:
        fail(str(e))


def sampling(temperature: float, top_k: int, top_p: float, min_p: float, seed: Optional[int]):
    """The sampling the decode options ask for; None for greedy (temperature 0)."""
    return Sampling(temperature, top_p, top_k, min_p, seed) if temperature > 0 else None

