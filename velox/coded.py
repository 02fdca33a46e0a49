"""Stored keys held as a codec's codes (:class:`CodedKeys`): what a composition
(``velox.compose``) hands a score in place of the stored rows. ``velox.attention`` scores
them (its ``candidate_logits`` and the rest) and re-exports the class; ``velox.evict`` and
``velox.ragged`` recognise them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

__all__ = ["CodedKeys"]


class CodedKeys(NamedTuple):
    """Stored keys held as a codec's codes (``velox.codecs``): logits of queries against them
    are the codec's estimates, ``codec.scores`` (``scores_np`` where the codes and tables are
    NumPy arrays: one head of a ``reference`` score), never a decode.

    ``codes`` holds the first :attr:`coded` keys (leading axes ``[b, h, n]``; ``[1, 1, n]``
    for one head). ``rows`` are the keys as rows for whatever reads rows rather than logits
    (the eviction skeleton's gather of the survivors): the coded keys decoded, and for one
    head of a ``reference`` score (``[N, d]``: every candidate) the ``N - n`` new keys after
    them, exact. MLX computes the decoded rows only where something reads them.
    """

    rows: Any
    codes: Any
    tables: Any
    codec: Any

    @property
    def coded(self) -> int:
        """Keys held as codes."""
        return self.codes[0].shape[2]

    def numpy(self) -> "CodedKeys":
        """The codes and tables as NumPy arrays (rows unchanged), for ``scores_np``."""
        def conv(x):  # bfloat16 (side data of a bfloat16 cache) has no NumPy dtype: float32
            if not isinstance(x, mx.array):
                return x
            return np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)

        return self._replace(codes=type(self.codes)(*map(conv, self.codes)),
                             tables=type(self.tables)(*map(conv, self.tables)))

    def head(self, i: int, j: int, rows: np.ndarray) -> "CodedKeys":
        """Row ``i``, kv head ``j`` of NumPy codes (:meth:`numpy`), with one head's ``rows``
        (and tables, where the codec holds a fit a row and head: its ``head``)."""
        tables = self.tables if self.codec.head is None else self.codec.head(self.tables, i, j)
        return self._replace(rows=rows, tables=tables,
                             codes=type(self.codes)(*(x[i:i + 1, j:j + 1] for x in self.codes)))
