"""A reusable llama_batch filled from Python: one entry per (token, pos, seq, wants-logits)."""

import llama_cpp


class Batch:
    """A llama_batch of fixed capacity; `add` returns the row index of the token."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.struct = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.n_tokens = 0

    def __len__(self) -> int:
        return self.n_tokens

    def clear(self) -> None:
        """Empty the batch for the next step."""
        self.n_tokens = 0
        self.struct.n_tokens = 0

    def add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        """Append one token of sequence `seq_id` at position `pos`; returns its row index."""
        i = self.n_tokens
        if i >= self.capacity:
            raise OverflowError(f"batch is full ({self.capacity} tokens)")
        s = self.struct
        s.token[i] = token
        s.pos[i] = pos
        s.n_seq_id[i] = 1
        s.seq_id[i][0] = seq_id
        s.logits[i] = logits
        self.n_tokens = s.n_tokens = i + 1
        return i

    def entries(self) -> list[tuple[int, int, int, bool]]:
        """The batch's (token, pos, seq_id, logits) entries, read back from the C arrays (for draft
        models that mirror the target's decodes; nothing else needs them, so they are not kept)."""
        s = self.struct
        return [(s.token[i], s.pos[i], s.seq_id[i][0], bool(s.logits[i])) for i in range(self.n_tokens)]

    def free(self) -> None:
        """Release the C arrays."""
        if self.struct is not None:
            llama_cpp.llama_batch_free(self.struct)
            self.struct = None
