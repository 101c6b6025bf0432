"""Several requests verified together: ``n`` slots (LlamaTargets) on one llama.cpp context, each
step's rows in one llama_decode (``verify_together``, llama_target.py); llama-server's parallel
slots, with trees.
"""

from __future__ import annotations

from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import MAX_WIDTH, Layout
from adaspark_core.engine.base import Verified
from adaspark_core.engine.bindings import MAX_SEQ, UINT32_MAX, FreedWithObject, thread_count
from adaspark_core.engine.llama import LlamaModel
from adaspark_core.engine.llama_context import LlamaContext, context_size
from adaspark_core.engine.llama_target import LlamaTarget, verify_together


class LlamaBatch(FreedWithObject):
    """``n`` slots on one llama.cpp context, each a LlamaTarget with ``n_ctx`` positions and
    ``MAX_SEQ // n`` sequences of its own (so its trees hold at most that many rows), for
    requests verified together (``verify_together``): llama-server's parallel slots, with trees.
    The unified cache holds every slot's cells; a step's rows attend every cell in use (masked to
    their own slot's), so a step costs what its rows and the slots' contexts together cost."""

    def __init__(self, model: LlamaModel, n: int, n_ctx: int | None = None, threads: int | None = None,
                 max_width: int = MAX_WIDTH, reuse_prefix: bool = False, prefill_per_step: int | None = None):
        if model.recurrent:
            raise InputError(f"{model.path.name} is recurrent/hybrid: its state has no slots to batch requests in")
        if not 1 <= n <= MAX_SEQ:
            raise InputError(f"parallel requests must be 1 to {MAX_SEQ}, got {n}")
        per_slot = MAX_SEQ // n if n > 1 else min(max_width, MAX_SEQ)
        width = min(max_width, per_slot)
        n_ctx = context_size(model, n_ctx)
        # Every slot's context, plus a tree's rows beyond it for each (a verify near the end of a
        # slot's context must still find cells).
        cells = n * (n_ctx + width)
        if cells > UINT32_MAX:
            raise InputError(f"{n} slots of {n_ctx} tokens are more than llama.cpp can hold")
        self._c = LlamaContext(model, cells, per_slot * n, max(512, n * width), n * width, thread_count(threads),
                                False, width)
        # A joining request's prompt fills what a step's batch has room for, as llama-server fills
        # its n_batch; ``prefill_per_step`` bounds it lower (shorter steps while a prompt goes in).
        if prefill_per_step is not None:
            self._c.prefill_budget = max(1, prefill_per_step)
        self.slots = [LlamaTarget(model, n_ctx, threads, width, reuse_prefix=reuse_prefix,
                                  shared=(self._c, i * per_slot, per_slot)) for i in range(n)]

    def verify(self, items: list[tuple[LlamaTarget, Layout]], prefill: list[LlamaTarget] = ()) -> list[Verified]:
        """Several slots' layouts in one llama_decode, with chunks of the ``prefill`` slots'
        pending prompts (``verify_together``)."""
        return verify_together(items, prefill)

    def close(self) -> None:
        for s in getattr(self, "slots", []):
            s.close()
        if getattr(self, "_c", None) is not None:
            self._c.close()
