"""Retrieval metrics of an embedding: Recall@K (the MS and SOP papers' metric), precision@1, MAP@R
and NMI, leave-one-out on one set or queries against a gallery.

Similarity is cosine (rows are L2-normalised first), as the loss uses. The k nearest neighbours come
from faiss (`IndexFlatIP`, exact) when it is installed, else from chunked torch products and top-k:
neither ever holds the N x N similarity matrix. Leave-one-out excludes each query's own row by index,
never by value, so duplicates of a query still count. Rows are compared in float32, whatever their
dtype, and neighbours of equal similarity (duplicate rows) come in an order that is each search's
own: faiss and torch can then give different figures, each one a ranking the ties allow. NMI's
k-means, too, is faiss's where installed and scikit-learn's otherwise, which cluster differently.

Recall@K, precision@1 and MAP@R need torch alone; faiss (faiss-cpu) and numpy, its array type, are
imported only on the faiss path. NMI needs scikit-learn (`pip install "ms-loss-cuda[eval]"`).
"""
import operator
import warnings

import torch
import torch.nn.functional as F

from .common import check_dense, check_key_dtypes

__all__ = ["evaluate", "knn", "map_at_r", "nmi", "precision_at_1", "recall_at_k"]
QUERY_CHUNK = 4096  # queries searched at a time: bounds the memory by QUERY_CHUNK x (N + k)


def _faiss():
    try:
        import faiss
    except ImportError:
        return None
    return faiss


def _float32_array(rows):
    """A C-contiguous float32 numpy array of a CPU tensor, the input faiss takes (numpy is there
    whenever faiss is: faiss depends on it)."""
    import numpy as np

    return np.ascontiguousarray(rows.detach().cpu().numpy(), dtype=np.float32)


def _validated(embeddings, labels, name):
    """(embeddings, labels) after checking them: a non-empty 2-D tensor of finite values (a NaN row has
    no neighbours: faiss would return index -1 for it, which reads the last row's label) and one label
    a row, integers or bools; the labels on the CPU as int64 (the sorts and searches take no unsigned
    or boolean keys; uint64's bits are kept, so equal labels stay equal)."""
    labels_name = "labels" if name == "embeddings" else f"{name}_labels"
    for what, value in ((name, embeddings), (labels_name, labels)):
        if not isinstance(value, torch.Tensor):  # (a numpy array: torch.from_numpy makes it one)
            raise TypeError(f"{what} must be a torch tensor, got {type(value).__name__}")
        check_dense(what, value)
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"{labels_name} must be integers (class indices) or bools, got {labels.dtype}")
    if embeddings.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [N, D], got shape {tuple(embeddings.shape)}")
    if embeddings.is_complex() or embeddings.dtype == torch.bool:
        raise TypeError(f"{name} must be real numbers, got {embeddings.dtype}")
    if labels.shape != (embeddings.shape[0],):
        raise ValueError(f"{labels_name} must have shape [{embeddings.shape[0]}], got {tuple(labels.shape)}")
    if embeddings.numel() == 0:
        raise ValueError(f"{name} must have at least one row and one column, got shape {tuple(embeddings.shape)}")
    if not torch.isfinite(embeddings.detach()).all():
        raise ValueError(f"{name} hold NaN or infinite values (a diverged model?): they have no nearest neighbours")
    labels = labels.detach().cpu()
    return embeddings, labels.view(torch.int64) if labels.dtype == torch.uint64 else labels.long()


def _checked(embeddings, labels, name):
    """`_validated`'s, the rows normalised in float32 on the CPU: each divided by its largest magnitude
    first, in float64, so that rows whose squares would overflow or vanish in float32 (or whose values
    lie outside float32's range) normalise as well as any other."""
    embeddings, labels = _validated(embeddings, labels, name)
    rows = embeddings.detach().double()
    largest = rows.abs().amax(dim=1, keepdim=True)
    rows = rows / torch.where(largest > 0, largest, torch.ones_like(largest))  # (a zero row stays zero)
    return F.normalize(rows.float(), dim=1).cpu(), labels


def _searcher(gallery, use_faiss):
    """search(queries, k) -> (similarities, indices) [Q, k] against `gallery`: faiss's exact inner-product
    index when installed (and use_faiss is not False), else a torch product and top-k."""
    if not (use_faiss is None or isinstance(use_faiss, bool)):
        raise ValueError(f"use_faiss must be None (faiss when installed), True or False, got {use_faiss!r}")
    faiss = _faiss() if use_faiss in (None, True) else None
    if use_faiss and faiss is None:
        raise RuntimeError("use_faiss=True, but faiss is not installed (pip install faiss-cpu)")
    if faiss is None:
        return lambda queries, k: torch.topk(queries @ gallery.T, k, dim=1)
    index = faiss.IndexFlatIP(gallery.shape[1])
    index.add(_float32_array(gallery))

    def search(queries, k):
        sims, ids = index.search(_float32_array(queries), k)
        return torch.from_numpy(sims), torch.from_numpy(ids).long()

    return search


def _knn_chunks(queries, gallery, k, leave_one_out, use_faiss, chunk):
    """Yields (first query row, similarities, indices) chunk after chunk of queries: nothing of size
    N x N, nor N x k, is ever held."""
    if gallery.shape[1] != queries.shape[1]:
        raise ValueError(f"gallery D = {gallery.shape[1]} differs from the queries' D = {queries.shape[1]}")
    available = gallery.shape[0] - (1 if leave_one_out else 0)
    if not 1 <= k <= available:
        raise ValueError(f"k = {k} needs between 1 and {available} gallery rows per query (gallery of "
                         f"{gallery.shape[0]}{', leave-one-out' if leave_one_out else ''})")
    search = _searcher(gallery, use_faiss)
    for start in range(0, queries.shape[0], chunk):
        sims, ids = search(queries[start:start + chunk], k + 1 if leave_one_out else k)
        if leave_one_out:  # drop each query's own row, or the last neighbour where it was not found
            own = ids == torch.arange(start, start + ids.shape[0], device=ids.device)[:, None]
            own[:, -1] |= ~own.any(dim=1)
            sims, ids = sims[~own].view(-1, k), ids[~own].view(-1, k)
        yield start, sims, ids


def knn(queries, gallery, k, *, leave_one_out=False, use_faiss=None, chunk=None):
    """(similarities, indices) [Q, k] of each query's k most similar gallery rows by inner product, most
    similar first (rows already normalised; float32). With leave_one_out the gallery is the query set
    and row i never retrieves itself. use_faiss: None picks faiss when installed; True needs it; False
    uses torch. chunk: queries searched at a time (QUERY_CHUNK by default)."""
    for name, rows in (("queries", queries), ("gallery", gallery)):
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or not rows.is_floating_point():
            raise ValueError(f"{name} must be a 2-D floating-point tensor [N, D], got "
                             f"{tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}"
                             f"{f' of {rows.dtype}' if isinstance(rows, torch.Tensor) else ''}")
    if leave_one_out and queries.shape[0] != gallery.shape[0]:
        raise ValueError(f"leave_one_out needs the queries to be the gallery, got {queries.shape[0]} queries "
                         f"and {gallery.shape[0]} gallery rows")
    if not _is_one_integer(k) or isinstance(k, bool):
        raise ValueError(f"k must be an integer, got {k!r}")
    if chunk is not None and (not _is_one_integer(chunk) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"chunk must be an integer >= 1 (or None: {QUERY_CHUNK}), got {chunk!r}")
    for name, rows in (("queries", queries), ("gallery", gallery)):
        if not torch.isfinite(rows.detach()).all():
            raise ValueError(f"{name} hold NaN or infinite values (a diverged model?): they have no nearest neighbours")
        if rows.dtype == torch.float64 and not torch.isfinite(rows.detach().float()).all():
            raise ValueError(f"{name} hold values beyond float32's range, in which the search runs: "
                             f"normalise the rows first")
    queries, gallery = queries.detach().float(), gallery.detach().float()
    parts = list(_knn_chunks(queries, gallery, operator.index(k), leave_one_out, use_faiss, chunk or QUERY_CHUNK))
    if not parts:  # (no queries)
        return torch.empty(0, k), torch.empty(0, k, dtype=torch.int64)
    return torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


def _neighbour_labels(embeddings, labels, gallery, gallery_labels, k, use_faiss):
    """Yields (query labels, labels of their k nearest gallery rows) chunk after chunk of queries."""
    _check_gallery(gallery, gallery_labels, labels)
    queries, query_labels = _checked(embeddings, labels, "embeddings")
    if gallery is None:
        gallery, gallery_labels = queries, query_labels
    else:
        gallery, gallery_labels = _checked(gallery, gallery_labels, "gallery")
    for start, _, ids in _knn_chunks(queries, gallery, k, gallery is queries, use_faiss, QUERY_CHUNK):
        yield query_labels[start:start + ids.shape[0]], gallery_labels[ids]


def _check_gallery(gallery, gallery_labels, labels):
    if gallery is None and gallery_labels is not None:
        raise ValueError("gallery_labels were given without a gallery (leave-one-out on the embeddings "
                         "takes their own labels): pass gallery= too, or leave both out")
    if isinstance(labels, torch.Tensor) and isinstance(gallery_labels, torch.Tensor):
        check_key_dtypes("labels", labels, "gallery_labels", gallery_labels)


def _relevant_counts(query_labels, gallery_labels, leave_one_out):
    """Per query, how many gallery rows share its label (itself excluded when leave-one-out)."""
    values, counts = torch.unique(gallery_labels, return_counts=True)
    position = torch.searchsorted(values, query_labels).clamp_max(values.numel() - 1)
    found = torch.where(values[position] == query_labels, counts[position], 0)
    return found - (1 if leave_one_out else 0)


def _is_one_integer(value):
    """A Python, numpy or 0-d tensor integer (a k alone, where a sequence of them is expected)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def recall_at_k(embeddings, labels, ks=(1, 10, 100, 1000), *, gallery=None, gallery_labels=None, use_faiss=None):
    """{k: fraction of queries with at least one row of their label among their k nearest}."""
    given = (ks,) if _is_one_integer(ks) or not hasattr(ks, "__iter__") else tuple(ks)
    if not given or not all(_is_one_integer(k) and not isinstance(k, bool) and k >= 1 for k in given):
        raise ValueError(f"ks must hold at least one k, each an integer at least 1, got {ks}")
    ks = sorted(set(operator.index(k) for k in given))
    found = torch.zeros(len(ks), dtype=torch.int64)
    for query_labels, near in _neighbour_labels(embeddings, labels, gallery, gallery_labels, ks[-1], use_faiss):
        first_hit = torch.where((near == query_labels[:, None]).any(dim=1),
                                (near == query_labels[:, None]).int().argmax(dim=1), ks[-1])
        found += (first_hit[:, None] < torch.tensor(ks)[None, :]).sum(dim=0)
    return {k: found[i].item() / embeddings.shape[0] for i, k in enumerate(ks)}


def precision_at_1(embeddings, labels, *, gallery=None, gallery_labels=None, use_faiss=None):
    """Recall@1: the fraction of queries whose nearest row has their label, over every query
    (pytorch-metric-learning's leaves out the queries without another row of their label)."""
    return recall_at_k(embeddings, labels, (1,), gallery=gallery, gallery_labels=gallery_labels,
                       use_faiss=use_faiss)[1]


def map_at_r(embeddings, labels, *, gallery=None, gallery_labels=None, use_faiss=None):
    """MAP@R (Musgrave et al., 2020): R = the number of rows of the query's label in the gallery; the
    mean over queries of (1/R) sum_{i <= R} precision@i over the relevant positions i. Queries with
    R = 0 are left out; NaN, with a warning, when every query has R = 0."""
    _check_gallery(gallery, gallery_labels, labels)
    _, keys = _validated(embeddings, labels, "embeddings")  # (int64: the caller's labels go on to the search)
    reference_keys = keys if gallery is None else _validated(gallery, gallery_labels, "gallery")[1]
    r = _relevant_counts(keys, reference_keys, gallery is None)
    if int(r.max()) <= 0:
        warnings.warn("MAP@R is undefined (NaN): no query's label occurs in the gallery besides itself")
        return float("nan")
    ranks = torch.arange(1, int(r.max()) + 1, dtype=torch.float32)
    total, start = 0.0, 0
    for query_labels, near in _neighbour_labels(embeddings, labels, gallery, gallery_labels, int(r.max()), use_faiss):
        r_chunk = r[start:start + near.shape[0]]
        start += near.shape[0]
        relevant = (near == query_labels[:, None]).float() * (ranks[None, :] <= r_chunk[:, None])
        precision = relevant.cumsum(dim=1) / ranks
        total += ((precision * relevant).sum(dim=1) / r_chunk.clamp_min(1)).sum().item()
    return total / int((r > 0).sum())


def nmi(embeddings, labels, *, seed=0):
    """Normalised mutual information between the labels and a k-means clustering (k = number of
    classes) of the normalised embeddings (faiss k-means with 5 restarts when installed, else
    scikit-learn's k-means++ with 3)."""
    try:
        from sklearn.metrics import normalized_mutual_info_score
    except ImportError as error:
        raise ImportError(f"nmi needs scikit-learn ({error}): pip install scikit-learn, or "
                          f"pip install \"ms-loss-cuda[eval]\"") from error
    if not _is_one_integer(seed) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    seed = operator.index(seed)  # (faiss takes a Python int alone)
    x, labels = _checked(embeddings, labels, "embeddings")
    classes = int(torch.unique(labels).numel())
    faiss = _faiss()
    if faiss is not None:
        kmeans = faiss.Kmeans(x.shape[1], classes, niter=20, nredo=5, seed=seed, verbose=False)
        kmeans.train(_float32_array(x))
        assignment = kmeans.index.search(_float32_array(x), 1)[1][:, 0]
    else:
        from sklearn.cluster import KMeans

        assignment = KMeans(n_clusters=classes, n_init=3, random_state=seed).fit_predict(x.numpy())
    return float(normalized_mutual_info_score(labels.numpy(), assignment))


def evaluate(embeddings, labels, ks=(1, 10, 100, 1000), *, gallery=None, gallery_labels=None, use_faiss=None,
             with_nmi=False):
    """All of the above in one dict: recall@k for each k, precision_at_1, map_at_r (and nmi)."""
    common = dict(gallery=gallery, gallery_labels=gallery_labels, use_faiss=use_faiss)
    results = {f"recall@{k}": v for k, v in recall_at_k(embeddings, labels, ks, **common).items()}
    results["precision_at_1"] = (results["recall@1"] if "recall@1" in results
                                 else precision_at_1(embeddings, labels, **common))
    results["map_at_r"] = map_at_r(embeddings, labels, **common)
    if with_nmi:
        results["nmi"] = nmi(embeddings, labels)
    return results
