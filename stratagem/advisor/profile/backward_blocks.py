"""Which block an operator belongs to, from the modules torch's module tracker says are running.

In forward the tracker is exact: a module is entered when called and left when it returns, so an
operator belongs to the block a running module is or lies in. In backward it enters a module once
its outputs' gradients are in and leaves it once its inputs' are, and two things follow: it can
hold a block's submodules without the block (a Hugging Face BLOOM block enters only at its
attention's dropout, after its MLP's and its output projection's backward ran), and it can keep a
module it never leaves, one of whose inputs gets no gradient (OPT's attention), long after its
block is done. :class:`BackwardBlocks` follows each block's backward from the tracker's sets as the
operators come: a block entered and then left is done, and what is left of it no longer counts;
an operator that no running module places counts in the block backward is in the middle of, if
any (BLOOM's scores' gradients run between its attention's modules), else in the embedding or
head (docs/cost-model.md, "Inputs and conventions").
"""

from __future__ import annotations


class BackwardBlocks:
    """The blocks of a model by the module tracker's names (``block_of``: tracker name -> block
    FQN), and their progress through one backward."""

    def __init__(self, block_of: dict[str, str]) -> None:
        self._block_of = block_of
        self._within: dict[str, str | None] = {}
        self._ancestors = {name.rsplit(".", depth)[0] for name in block_of
                           for depth in range(1, name.count(".") + 1)}  # the model, its block lists
        self._entered: set[str] = set()  # blocks the tracker holds now
        self._done: set[str] = set()  # blocks the tracker entered and left
        self.last: str | None = None  # the block backward last ran in

    def within(self, name: str) -> str | None:
        """The block the module the tracker calls ``name`` is or lies in (by its name), or None."""
        if name not in self._within:
            parent = name
            while parent and parent not in self._block_of:
                parent = parent.rpartition(".")[0]
            self._within[name] = self._block_of.get(parent)
        return self._within[name]

    def segment(self, parents: set[str]) -> str | None:
        """The block a backward operator run while the tracker holds ``parents`` belongs to, or
        None for the embedding's or head's (module docstring)."""
        entered = {self._block_of[name] for name in parents if name in self._block_of}
        self._done |= self._entered - entered
        self._entered = entered
        block = next(iter(entered), None) or next(
            (b for name in parents if (b := self.within(name)) is not None and b not in self._done), None)
        if block is None and self.last is not None and self.last not in self._done and not any(
                name != "Global" and name not in self._ancestors and self.within(name) is None for name in parents):
            block = self.last  # between a block's modules, none beside the blocks: the block's own code
        if block is not None:
            self.last = block
        return block
