"""A reusable llama_batch filled from Python: one entry per (token, pos, seq, wants-logits)."""

import llama_cpp


class Batch:
    """A llama_batch of fixed capacity; `add` returns the row index of the token."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.struct = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.entries: list[tuple[int, int, int, bool]] = []

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def room(self) -> int:
        """How many more tokens fit."""
        return self.capacity - len(self.entries)

    def clear(self) -> None:
        """Empty the batch for the next step."""
        self.entries.clear()
        self.struct.n_tokens = 0

    def add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        """Append one token of sequence `seq_id` at position `pos`; returns its row index."""
        i = len(self.entries)
        if i >= self.capacity:
            raise OverflowError(f"batch is full ({self.capacity} tokens)")
        s = self.struct
        s.token[i] = token
        s.pos[i] = pos
        s.n_seq_id[i] = 1
        s.seq_id[i][0] = seq_id
        s.logits[i] = logits
        s.n_tokens = i + 1
        self.entries.append((token, pos, seq_id, logits))
        return i

    def free(self) -> None:
        """Release the C arrays."""
        if self.struct is not None:
            llama_cpp.llama_batch_free(self.struct)
            self.struct = None
