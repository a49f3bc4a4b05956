"""TF-IDF features + KMeans for grouping subtask descriptions (paper App. L.1, K = 8 clusters).

A small numpy re-implementation of what the paper's diagnostic uses (scikit-learn's
``TfidfVectorizer`` defaults and ``KMeans`` with k-means++ seeding), so the analysis does not
pull in scikit-learn. Deterministic for a seed.

TF-IDF (scikit-learn defaults): lower-cased tokens of 2+ word characters, raw term counts,
smooth idf = ln((1 + n) / (1 + df)) + 1, rows L2-normalised.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

_TOKEN = re.compile(r"(?u)\b\w\w+\b")


def tfidf(texts: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """TF-IDF matrix float64[N, V] (unit rows; all-zero for a text without tokens) and the vocabulary."""
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be a sequence of strings, not a single string")
    docs = []
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
        docs.append(_TOKEN.findall(t.lower()))
    vocab = sorted({w for d in docs for w in d})
    index = {w: j for j, w in enumerate(vocab)}
    tf = np.zeros((len(docs), len(vocab)))
    for i, d in enumerate(docs):
        for w in d:
            tf[i, index[w]] += 1
    df = (tf > 0).sum(axis=0)
    idf = np.log((1 + len(docs)) / (1 + df)) + 1.0
    x = tf * idf
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0), vocab


def _kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    centres = [x[rng.integers(len(x))]]
    d2 = np.sum((x - centres[0]) ** 2, axis=1)
    for _ in range(1, k):
        total = d2.sum()
        i = rng.choice(len(x), p=d2 / total) if total > 0 else rng.integers(len(x))
        centres.append(x[i])
        d2 = np.minimum(d2, np.sum((x - x[i]) ** 2, axis=1))
    return np.stack(centres)


def kmeans(x: np.ndarray, k: int, *, seed: int = 0, n_init: int = 10, max_iter: int = 300) -> np.ndarray:
    """Lloyd's KMeans with k-means++ seeding; the best of ``n_init`` runs by inertia.

    Args:
      x: float[N, D] points (N >= k distinct points); k: clusters.
    Returns:
      int64[N] labels in [0, k), numbered by first appearance (so equal partitions compare equal).
    """
    x = np.asarray(x, np.float64)
    if x.ndim != 2:
        raise ValueError(f"x must be [N, D], got shape {x.shape}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"n_clusters must be a positive int, got {k!r}")
    distinct = len(np.unique(x, axis=0))
    if distinct < k:
        raise ValueError(f"n_clusters={k} exceeds the {distinct} distinct points to cluster")
    rng = np.random.default_rng(seed)
    best, best_inertia = None, np.inf
    for _ in range(n_init):
        c = _kmeans_pp(x, k, rng)
        labels = None
        for _ in range(max_iter):
            d2 = np.sum((x[:, None, :] - c[None]) ** 2, axis=-1)  # [N, k]
            new = d2.argmin(axis=1)
            for j in range(k):  # an emptied cluster takes the point farthest from its centre
                if not np.any(new == j):
                    far = int(d2[np.arange(len(x)), new].argmax())
                    new[far] = j
                    d2[far] = 0.0
            if labels is not None and np.array_equal(new, labels):
                break
            labels = new
            c = np.stack([x[labels == j].mean(axis=0) for j in range(k)])
        inertia = float(np.sum((x - c[labels]) ** 2))
        if inertia < best_inertia - 1e-12:
            best, best_inertia = labels, inertia
    _, first = np.unique(best, return_index=True)
    order = {int(best[i]): n for n, i in enumerate(sorted(first))}
    return np.array([order[int(j)] for j in best], np.int64)


def cluster_texts(texts: Sequence[str], k: int, *, seed: int = 0) -> np.ndarray:
    """TF-IDF + KMeans cluster ids int64[N] for ``texts`` (App. L.1's subtask clusters)."""
    x, _ = tfidf(texts)
    return kmeans(x, k, seed=seed)
