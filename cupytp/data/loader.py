"""Batches of (input, target) windows from a token file, split across data-parallel ranks.

Two ways to draw windows of seq_len + 1 tokens (`sampling`):
- "epoch" (the default): the tokens are cut into windows that start every seq_len tokens. One
  global stream orders all windows, epoch after epoch (each epoch a fresh permutation seeded
  with seed + epoch), so each epoch sees every window once.
- "random": each window starts at a random offset in 0..N-seq_len-1, as nanoGPT's `get_batch`
  draws them; step s's offsets come from a generator seeded with (seed, s).
Either way every step takes the next batch_size * dp_size windows: dp rank r gets the r-th block
of batch_size. So dp_size=2 sees exactly the windows of dp_size=1 with twice the batch, and
tensor-parallel ranks that pass the same dp_rank get the same batch.
"""
import os

import numpy as np

from cupytp.data.token_file import DataError, read_tokens

SAMPLINGS = ("epoch", "random")


class TokenLoader:
    """`next_batch()` -> (x, y), int64 arrays of shape (batch_size, seq_len), y = x shifted by one.

    `step` is the index of the next batch; set it to resume a run where it stopped. With
    `vocab_size`, a batch holding a token id outside 0..vocab_size-1 is a DataError.
    """

    def __init__(self, path_or_tokens, batch_size, seq_len, dp_rank=0, dp_size=1, seed=0,
                 shuffle=True, sampling="epoch", vocab_size=None):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} "
                             f"and {seq_len}")
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling {sampling!r} is not one of {', '.join(SAMPLINGS)}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in 0..{dp_size - 1} (dp_size {dp_size})")
        if isinstance(path_or_tokens, (str, os.PathLike)):
            tokens, source = read_tokens(path_or_tokens), f"the file {os.fspath(path_or_tokens)}"
        else:
            tokens, source = path_or_tokens, "the token array"
        self.tokens = np.asarray(tokens)                    # a plain view; no copy of a memmap
        if self.tokens.ndim != 1:
            raise DataError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        if self.tokens.size < seq_len + 1:
            raise DataError(f"sequence length {seq_len} needs at least {seq_len + 1} tokens; "
                            f"{source} has {self.tokens.size}")
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.source = source
        self.num_windows = (self.tokens.size - 1) // seq_len
        self.step = 0
        self._epoch_order = (None, None)                    # (epoch, its window order)

    def next_batch(self):
        """This rank's batch for `step`, then advance `step`."""
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def batch_at(self, step):
        """This rank's (x, y) for global step `step`; the same on every call."""
        global_batch = self.batch_size * self.dp_size
        if self.sampling == "random":
            offsets = np.random.default_rng((self.seed, step)).integers(
                0, self.tokens.size - self.seq_len, size=global_batch)
            starts = offsets[self.dp_rank * self.batch_size:][:self.batch_size]
        else:
            first = step * global_batch + self.dp_rank * self.batch_size
            starts = self._window_starts(first, self.batch_size)
        offsets = np.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets].astype(np.int64)  # (B, T+1)
        if self.vocab_size is not None and windows.max() >= self.vocab_size:
            raise DataError(f"token id {int(windows.max())} in {self.source} is outside the "
                            f"vocabulary of {self.vocab_size}: the tokens were made with another "
                            "tokenizer (--tokenizer; a nanoGPT directory's meta.pkl)")
        x = np.ascontiguousarray(windows[:, :-1])                          # (B, T)
        y = np.ascontiguousarray(windows[:, 1:])                           # (B, T)
        return x, y

    def state_dict(self):
        """Where the stream stands: windows taken so far by all dp ranks, and what orders them."""
        return {"windows": self.step * self.batch_size * self.dp_size, "seed": self.seed,
                "shuffle": self.shuffle, "sampling": self.sampling, "seq_len": self.seq_len,
                "num_windows": self.num_windows}

    def load_state_dict(self, state):
        """Continue the stream of `state` (from `state_dict()`, maybe of another dp size) after
        its windows; the stream must be the same and this loader's global batch must divide the
        windows taken."""
        mine = self.state_dict()
        state = {"sampling": "epoch", **state}          # states saved before random sampling
        changed = [name for name in ("seed", "shuffle", "sampling", "seq_len", "num_windows")
                   if state[name] != mine[name]]
        if changed:
            raise ValueError("the data stream differs from the saved one in " + ", ".join(
                f"{name} ({state[name]} saved, {mine[name]} now)" for name in changed))
        global_batch = self.batch_size * self.dp_size
        if state["windows"] % global_batch:
            raise ValueError(f"{state['windows']} windows were taken, not a whole number of "
                             f"global batches of {global_batch} (batch_size {self.batch_size} "
                             f"x dp {self.dp_size})")
        self.step = state["windows"] // global_batch

    def val_batches(self, num_batches):
        """Yield the batches of steps 0..num_batches-1: a fixed set, whatever `step` is."""
        for step in range(num_batches):
            yield self.batch_at(step)

    def _window_starts(self, first, count):
        """Token offsets of windows first..first+count-1 of the global stream."""
        stream_index = np.arange(first, first + count)
        epochs = stream_index // self.num_windows
        positions = stream_index % self.num_windows
        starts = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            starts[in_epoch] = self._order(int(epoch))[positions[in_epoch]] * self.seq_len
        return starts

    def _order(self, epoch):
        """The window order of `epoch`: a permutation seeded with seed + epoch, or 0..W-1."""
        cached_epoch, order = self._epoch_order
        if cached_epoch != epoch:
            if self.shuffle:
                order = np.random.default_rng(self.seed + epoch).permutation(self.num_windows)
            else:
                order = np.arange(self.num_windows)
            self._epoch_order = (epoch, order)
        return order
