"""The ``adaspark`` command line: parse, call adaspark_core, print. Text goes to stdout,
diagnostics to stderr; bad usage or bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import codecs
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import orjson
import typer

from adaspark_core.errors import InputError, OutputError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Speculative decoding with tree verification for llama.cpp models (AdaSpark).",
)


@app.callback()
def _main() -> None:
    """AdaSpark: speculative decoding with tree verification for llama.cpp models."""


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
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0)
    except KeyboardInterrupt:
        typer.echo("", err=True)
        raise typer.Exit(130)


def read_prompt(path: str) -> str:
    if path == "-":
        if sys.stdin is None:
            fail("stdin is closed: give the prompt on stdin or name a prompt file")
        raw, what = sys.stdin.buffer.read(), "stdin"
    else:
        p = Path(path)
        if p.is_dir():
            fail(f"the prompt {p} is a directory; name a text file")
        try:
            raw, what = p.read_bytes(), f"prompt file {p}"
        except FileNotFoundError:
            fail(f"prompt file not found: {p}")
        except OSError as e:
            fail(f"cannot read the prompt file {p}: {e.strerror or e}")
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


def histogram(counts: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


@app.command()
def decode(
    prompt_file: str = typer.Argument(..., help="File with the prompt text, or - for stdin."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="GGUF model file (default: SmolLM2-135M-Instruct, Q4_0)."),
    arm: str = typer.Option("adaspark", "--arm", help="adaspark, cost, pinned:N, tree:N, chain:N or ar (see below)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="Most tokens to generate."),
    raw: bool = typer.Option(False, "--raw", help="Send the text as is, without the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message (chat mode)."),
    log: Optional[Path] = typer.Option(None, "--log", help="Append one JSON line per round to this file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text and statistics) instead of streaming."),
    n_ctx: Optional[int] = typer.Option(None, "--n-ctx", min=16, help="Context size (default: the model's, at most 8192)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads (default: all)."),
    store: Optional[Path] = typer.Option(None, "--store", help="Learned state for the learning arms (default: one per model and machine, in the cache)."),
    drafter: str = typer.Option("none", "--drafter", help="none (n-gram candidates only), dspark:FILE (a DSpark block drafter GGUF made for the model) or model:FILE (a draft model with the model's vocabulary)."),
    block: Optional[int] = typer.Option(None, "--block", min=1, help="Positions a model drafter proposes per round (B; default: a DSpark file's block size, 4 for a draft model)."),
    top_k: int = typer.Option(8, "--top-k", min=1, help="Candidates a model drafter keeps per position (K)."),
) -> None:
    """Decode a reply to PROMPT_FILE, streaming it to stdout; a summary goes to stderr.

    Arms: ar, chain:N (at most N draft tokens), tree:N (N rows), pinned:N (N rows, learners on),
    cost (learned width, no n-gram), adaspark (learned width with n-gram candidates)."""
    from adaspark_core.record import RoundLog
    from adaspark_core.scheduler import Generation, parse_arm

    text = read_prompt(prompt_file)
    system = utf8(system, "--system") if system is not None else None
    with reported():
        the_arm = parse_arm(arm)
        lm, target, the_drafter = load_engine(model, n_ctx, threads, drafter, block, top_k)
        if raw:
            prompt = lm.tokenize(text)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            prompt = lm.chat_prompt(messages)
        learned = open_learned(store, lm.path, the_drafter) if the_arm.learns else None
        learners = learned[1] if learned else None
        gen = Generation(target, prompt, the_arm, max_tokens, request_id=Path(prompt_file).name, learners=learners,
                         drafter=the_drafter)
        gen.log = RoundLog(log) if log else None
        try:
            text_out = stream(gen, lm.piece, to=None if as_json else sys.stdout)
        finally:
            if gen.log:
                gen.log.close()
            if learned:
                save_learned(learned, gen.stats.rounds)
        st = gen.stats
        if as_json:
            summary = {"model": str(lm.path), "arm": the_arm.name, "prompt_tokens": len(prompt), "finish": gen.finish}
            sys.stdout.write(orjson.dumps({"text": text_out, **summary, **st.to_json()}).decode() + "\n")
            return
        sys.stdout.write("\n")
        sys.stdout.flush()
        tps = f"{st.decode_tps:.1f} tok/s" if st.decode_tps else "n/a (one delta)"
        typer.echo(
            f"[{the_arm.name}] {st.generated} tokens in {st.rounds} rounds "
            f"({st.tokens_per_round:.2f} tokens/round), decode {tps}, finish {gen.finish}\n"
            f"  widths (rows: rounds)      {histogram(st.widths)}\n"
            f"  accepted (drafts: rounds)  {histogram(st.accepted)}",
            err=True,
        )


@app.command()
def replay(
    logs: list[Path] = typer.Argument(..., help="Round logs written by --log (JSON lines), replayed in the order given (e.g. a compare run's warm-adaspark.jsonl, then adaspark.jsonl)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    no_check: bool = typer.Option(False, "--no-check", help="Go on where replay and the log disagree."),
    regret: bool = typer.Option(False, "--regret", help="Add the hindsight account: what every width would have accepted and cost, the best single width, the per-round oracle, and the loss split by cause."),
    costs: Optional[list[Path]] = typer.Option(None, "--costs", help="More round logs (e.g. the other arms of the same bench) whose measured verify times price the widths; repeat it."),
) -> None:
    """Drive fresh learners through a logged run and report how they predicted: acceptance log
    loss per request (paper Table 2), calibration of S (Figure 10) and what the n-gram fill added
    (Table 7). Only rounds of learning arms (adaspark, pinned:N, cost) are replayed. With
    --regret, every arm of the log (fixed arms too) gets the hindsight account."""
    from adaspark_core.record import read_log
    from adaspark_core.replay import ReplayMismatch
    from adaspark_core.replay import replay as run_replay

    for p in [*logs, *(costs or [])]:
        if not p.is_file():
            fail(f"round log not found: {p}")
    log = logs[-1]
    with reported():
        try:
            def cut(message: str) -> None:
                sys.stderr.write(f"adaspark: {message}\n")

            records = [r for p in logs for r in read_log(p, cut)]
            _, rep = run_replay(records, check=not no_check)
            cost_records = [r for p in costs or [] for r in read_log(p, cut)]
        except ReplayMismatch as e:
            raise InputError(f"{log}: {e} (is the log from another version? --no-check goes on)") from None
        except ValueError as e:
            raise InputError(str(e)) from None
        if not rep.requests and not regret:
            raise InputError(f"{log}: no rounds of a learning arm (adaspark, pinned:N, cost) to replay")
        report = rep.to_json() if rep.requests else {}
        if regret:
            from adaspark_core.regret import CostTable, account

            table = CostTable(records + cost_records)
            arms: dict[str, list] = {}
            for r in records:
                arms.setdefault(r.arm, []).append(r)
            report["regret"] = [account(rs, table, rep.model_choices).to_json() for rs in arms.values()]
        if as_json:
            sys.stdout.write(orjson.dumps(report).decode() + "\n")
        else:
            from adaspark_cli.report import regret_tables, replay_tables

            if rep.requests:
                sys.stdout.write(replay_tables(report))
            if regret:
                sys.stdout.write(regret_tables(report["regret"]))


def load_engine(model: Optional[Path], n_ctx: Optional[int], threads: Optional[int], drafter: str,
                block: Optional[int], top_k: int):
    """(model, target, drafter) for the command-line options."""
    from adaspark_core.engine.drafters import make_drafter
    from adaspark_core.engine.llama import LlamaModel, LlamaTarget
    from adaspark_core.models import resolve_model

    lm = LlamaModel(resolve_model(model))
    target = LlamaTarget(lm, n_ctx=n_ctx, threads=threads)
    return lm, target, make_drafter(drafter, target, threads, block, top_k)


def open_learned(path: Optional[Path], model_path: Path, drafter=None):
    """(store, learners) for a learning arm: the learners restored from the store, or fresh. The
    store is keyed by the model, the model drafter if any, and the machine."""
    from adaspark_core.learned import Learners
    from adaspark_core.fingerprint import fingerprint
    from adaspark_core.store import Store, default_store_path

    fp = fingerprint(model_path, drafter.model.path if drafter is not None else None)
    st = Store.open(path or default_store_path(fp), fp)
    return st, Learners.from_store(st)


def save_learned(learned, rounds: int, requests: int = 1) -> None:
    """Write the learners into their store (atomically), counting what they have seen since."""
    st, learners = learned
    learners.to_store(st)
    st.bump(requests=requests, rounds=rounds)
    st.save()


def stream(gen, piece, to=None, on_text=None, stop=None) -> str:
    """Run a generation, decoding its tokens to text as they come (UTF-8 sequences may span
    tokens); write each round's text to ``to`` or pass it to ``on_text`` when given. ``stop()``
    is asked after every round and ends the reply early when true. Returns the whole text."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    parts: list[str] = []

    def out(text: str) -> None:
        parts.append(text)
        if text and to is not None:
            to.write(text)
            to.flush()
        if text and on_text is not None:
            on_text(text)

    rounds = iter(gen)
    try:
        for emitted in rounds:
            out(utf8.decode(b"".join(piece(t) for t in emitted)))
            if stop is not None and stop():
                break
    finally:
        rounds.close()  # the reply's last round learns when its generator ends (scheduler.Generation)
    out(utf8.decode(b"", final=True))
    return "".join(parts)


from adaspark_cli.compare_cmd import compare, simulate  # noqa: E402  (they use the helpers above)
from adaspark_cli.profile_cmd import profile  # noqa: E402
from adaspark_cli.serve import serve_stdin  # noqa: E402
from adaspark_cli.store_cmd import inspect_store, store_app  # noqa: E402

app.command("serve-stdin")(serve_stdin)
app.command("profile")(profile)
app.command("compare")(compare)
app.command("simulate")(simulate)
app.add_typer(store_app, name="store")
app.command("inspect-store")(inspect_store)


def main(args: list[str] | None = None) -> None:
    """The console entry point. Usage errors (a bad option value, an unknown option) are one
    line on stderr and exit code 2, as the core's input errors are: Typer's boxes are for
    ``--help``, not for a pipeline's log. Standard streams closed by the caller are put on
    /dev/null first, so no file the run opens takes their numbers."""
    import os

    closed = [fd for fd in (0, 1, 2) if not _is_open(fd)]
    for fd in closed:
        os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    if 2 in closed:
        sys.stderr = open(os.devnull, "w")
    if 1 in closed:
        sys.stderr.write("adaspark: error: stdout is closed: give the output somewhere to go (> FILE)\n")
        sys.exit(2)
    try:
        code = app(args=args, standalone_mode=False)
    except typer.TyperException as e:  # Click's usage errors
        if type(e).__name__ == "NoArgsIsHelpError":  # `adaspark` alone: the help, as --help
            e.show()
        else:
            ctx = getattr(e, "ctx", None)
            see = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            sys.stderr.write(f"adaspark: error: {' '.join(e.format_message().split())}{see}\n")
        sys.exit(getattr(e, "exit_code", 2))
    except typer.Abort:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _is_open(fd: int) -> bool:
    import os

    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
