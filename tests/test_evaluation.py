"""Retrieval metrics: hand-computed cases, faiss against torch, pytorch-metric-learning's
AccuracyCalculator, and the metrics with torch alone (no numpy, faiss or scikit-learn)."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ms_loss_cuda import evaluation

from conftest import make_batch

try:
    import faiss  # noqa: F401
except ImportError:
    faiss = None


def test_hand_computed_recall_and_map():
    # 1-D directions on a circle: each point's neighbours in order are known
    angles = torch.tensor([0.0, 0.1, 0.3, 3.0, 3.1])
    x = torch.stack([angles.cos(), angles.sin()], dim=1)
    labels = torch.tensor([0, 0, 1, 1, 1])
    # nearest of 0: 1 (hit); of 1: 0 (hit); of 2: 1 (miss), then 0 (miss), then 3; of 3: 4 (hit); of 4: 3 (hit)
    recall = evaluation.recall_at_k(x, labels, ks=(1, 2, 3), use_faiss=False)
    assert recall == {1: pytest.approx(4 / 5), 2: pytest.approx(4 / 5), 3: pytest.approx(1.0)}
    # R: 1, 1, 2, 2, 2. AP@R: 1, 1, 0 (nothing relevant in its first 2), 1, 1
    assert evaluation.map_at_r(x, labels, use_faiss=False) == pytest.approx(4 / 5)


def test_leave_one_out_is_by_index_so_duplicates_count():
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1, 1])
    assert evaluation.recall_at_k(x, labels, ks=(1,), use_faiss=False)[1] == 1.0
    _, ids = evaluation.knn(x, x, 1, leave_one_out=True, use_faiss=False)
    assert ids.squeeze(1).tolist() == [1, 0, 3, 2]


@pytest.mark.skipif(faiss is None, reason="faiss-cpu not installed")
@pytest.mark.parametrize("leave_one_out", [True, False])
def test_faiss_and_torch_agree(leave_one_out):
    x, labels = make_batch(700, 24, 40, dtype=torch.float32, seed=3, spread=2.0)
    queries = F.normalize(x, dim=1)
    gallery = queries if leave_one_out else F.normalize(make_batch(500, 24, 40, dtype=torch.float32, seed=4)[0], dim=1)
    sims_f, ids_f = evaluation.knn(queries, gallery, 50, leave_one_out=leave_one_out, use_faiss=True)
    sims_t, ids_t = evaluation.knn(queries, gallery, 50, leave_one_out=leave_one_out, use_faiss=False, chunk=97)
    torch.testing.assert_close(sims_f, sims_t, rtol=1e-5, atol=1e-5)
    assert (ids_f == ids_t).float().mean() > 0.999  # equal up to exact ties
    for use_faiss in (True, False):
        assert evaluation.recall_at_k(x, labels, (1, 10, 100), use_faiss=use_faiss) == \
            evaluation.recall_at_k(x, labels, (1, 10, 100), use_faiss=not use_faiss)


@pytest.mark.parametrize("query_gallery", [False, True])
def test_agrees_with_pytorch_metric_learning(query_gallery, monkeypatch):
    pytest.importorskip("pytorch_metric_learning")
    monkeypatch.setattr(evaluation, "QUERY_CHUNK", 37)  # several chunks of queries, the last one partial
    from pytorch_metric_learning.distances import CosineSimilarity
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
    from pytorch_metric_learning.utils.inference import CustomKNN

    x, labels = make_batch(600, 16, 50, dtype=torch.float32, seed=5, spread=1.5)
    calculator = AccuracyCalculator(include=("precision_at_1", "mean_average_precision_at_r"), k="max_bin_count",
                                    knn_func=CustomKNN(CosineSimilarity()))
    if query_gallery:
        queries, query_labels, gallery, gallery_labels = x[:200], labels[:200], x[200:], labels[200:]
        theirs = calculator.get_accuracy(queries, query_labels, gallery, gallery_labels, ref_includes_query=False)
        ours = evaluation.evaluate(queries, query_labels, ks=(1,), gallery=gallery, gallery_labels=gallery_labels,
                                   use_faiss=False)
    else:
        theirs = calculator.get_accuracy(x, labels, x, labels, ref_includes_query=True)
        ours = evaluation.evaluate(x, labels, ks=(1,), use_faiss=False)
    assert ours["precision_at_1"] == pytest.approx(theirs["precision_at_1"], abs=1e-6)
    assert ours["map_at_r"] == pytest.approx(theirs["mean_average_precision_at_r"], abs=1e-6)


@pytest.mark.parametrize("with_faiss", [pytest.param(True, marks=pytest.mark.skipif(faiss is None, reason="no faiss")),
                                        False])
def test_nmi_of_separated_classes_is_one(with_faiss, monkeypatch):
    if not with_faiss:
        monkeypatch.setattr(evaluation, "_faiss", lambda: None)
    centres = torch.eye(8) * 10
    labels = torch.arange(8).repeat_interleave(20)
    x = centres[labels] + 0.01 * torch.randn(160, 8, generator=torch.Generator().manual_seed(0))
    assert evaluation.nmi(x, labels) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="seed must be an integer, got None"):
        evaluation.nmi(x, labels, seed=None)


def test_bad_input():
    x, labels = torch.randn(10, 4), torch.arange(10) % 3
    with pytest.raises(ValueError, match="k = 10 needs between 1 and 9"):
        evaluation.recall_at_k(x, labels, ks=(1, 10), use_faiss=False)
    with pytest.raises(ValueError, match=r"labels must have shape \[10\], got \(5,\)"):
        evaluation.recall_at_k(x, labels[:5], ks=(1,))
    with pytest.raises(TypeError, match="embeddings must be a torch tensor, got ndarray"):
        evaluation.evaluate(x.numpy(), labels)
    for k in (2, torch.tensor(2), torch.tensor(2).numpy()[()]):  # (one k, of any integer type)
        assert evaluation.recall_at_k(x, labels, ks=k, use_faiss=False) == \
            evaluation.recall_at_k(x, labels, ks=(2,), use_faiss=False)
    with pytest.raises(ValueError, match="gallery D"):
        evaluation.recall_at_k(x, labels, ks=(1,), gallery=torch.randn(5, 3), gallery_labels=torch.arange(5))
    for ks in ((), (0, 1), (1.5, 2.9), (1, True), 2.0):  # (no k, k = 0, k that is not an integer)
        with pytest.raises(ValueError, match="ks must hold at least one k, each an integer at least 1"):
            evaluation.recall_at_k(x, labels, ks=ks, use_faiss=False)
    for function in (evaluation.recall_at_k, evaluation.map_at_r):
        with pytest.raises(ValueError, match="at least one row"):
            function(x[:0], labels[:0], use_faiss=False)
        with pytest.raises(TypeError, match="gallery_labels must be a torch tensor, got NoneType"):
            function(x, labels, gallery=x, gallery_labels=None, use_faiss=False)
        with pytest.raises(TypeError, match="labels must be a torch tensor, got list"):
            function(x, labels.tolist(), use_faiss=False)
    assert [t.shape for t in evaluation.knn(x[:0], x, 2, use_faiss=False)] == [(0, 2), (0, 2)]
    with pytest.raises(TypeError, match="embeddings must be real numbers, got torch.complex64"):
        evaluation.recall_at_k(torch.complex(x, x), labels, use_faiss=False)
    with pytest.raises(ValueError, match="gallery_labels were given without a gallery"):
        evaluation.evaluate(x, labels, ks=(1,), gallery_labels=labels, use_faiss=False)
    for kwargs, message in ((dict(chunk=-1), "chunk must be an integer >= 1"), (dict(chunk=0), "chunk must be"),
                            (dict(queries=x[0]), r"queries must be a 2-D floating-point tensor \[N, D\], got \(4,\)"),
                            (dict(gallery=x[:, :3]), "gallery D = 3 differs"), (dict(k=2.0), "k must be an integer"),
                            (dict(queries=x[:5], leave_one_out=True), "leave_one_out needs the queries to be the gallery")):
        with pytest.raises(ValueError, match=message):
            evaluation.knn(**dict(dict(queries=x, gallery=x, k=2, use_faiss=False), **kwargs))
    # labels that would compare wrongly: floats (distinct large integers merge), uint64 against int64 (2^63 wraps)
    with pytest.raises(TypeError, match="labels must be integers .* or bools, got torch.float32"):
        evaluation.evaluate(x, labels.float(), use_faiss=False)
    wrapped = torch.full((10,), torch.iinfo(torch.int64).min)
    with pytest.raises(TypeError, match=r"labels \(torch.uint64\) and gallery_labels \(torch.int64\) must share"):
        evaluation.evaluate(x, wrapped.view(torch.uint64), (1,), gallery=x, gallery_labels=wrapped, use_faiss=False)
    with pytest.raises(TypeError, match="embeddings must be a dense .* got torch.sparse_coo"):
        evaluation.evaluate(x.to_sparse(), labels, use_faiss=False)
    for use_faiss in ("no", 1):
        with pytest.raises(ValueError, match="use_faiss must be None .*, True or False"):
            evaluation.evaluate(x, labels, (1,), use_faiss=use_faiss)
    # (chunks of queries, and queries of another dtype than the gallery, give the same neighbours)
    whole = evaluation.knn(x, x, 2, use_faiss=False)
    for got in (evaluation.knn(x, x, 2, use_faiss=False, chunk=3), evaluation.knn(x.double(), x, 2, use_faiss=False)):
        assert torch.equal(got[1], whole[1])


@pytest.mark.parametrize("use_faiss", [False, pytest.param(True, marks=pytest.mark.skipif(
    faiss is None, reason="faiss-cpu not installed"))])
def test_the_metrics_do_not_depend_on_the_rows_lengths(use_faiss):
    """Cosine similarity ignores a row's length: rows whose squares overflow or vanish in float32, and
    float64 rows beyond float32's range, give the metrics of the rows as they were drawn."""
    x, labels = torch.randn(60, 8, generator=torch.Generator().manual_seed(3)), torch.arange(60) % 7
    expected = evaluation.evaluate(x, labels, ks=(1, 5), use_faiss=use_faiss)
    for scaled in (x * 1e19, x * 1e-20, x.double() * 1e40, x.double() * 1e-300):
        assert evaluation.evaluate(scaled, labels, ks=(1, 5), use_faiss=use_faiss) == expected


@pytest.mark.parametrize("use_faiss", [False, pytest.param(True, marks=pytest.mark.skipif(
    faiss is None, reason="faiss-cpu not installed"))])
def test_a_row_that_is_not_finite_is_refused(use_faiss):
    """A NaN row has no nearest neighbours (faiss returns index -1 for it, which would read the last
    row's label): the metrics refuse it, rather than give a number."""
    x, labels = torch.randn(10, 4), torch.arange(10) % 3
    for bad in (float("nan"), float("inf")):
        x[4, 1] = bad
        for function in (evaluation.recall_at_k, evaluation.map_at_r, evaluation.evaluate):
            with pytest.raises(ValueError, match="NaN or infinite"):
                function(x, labels, use_faiss=use_faiss)
        with pytest.raises(ValueError, match="gallery hold NaN or infinite"):
            evaluation.map_at_r(x[:3].abs().nan_to_num(), labels[:3], gallery=x, gallery_labels=labels,
                                use_faiss=use_faiss)
        for queries, gallery, name in ((x, x.nan_to_num(), "queries"), (x[:3].nan_to_num(), x, "gallery")):
            with pytest.raises(ValueError, match=f"{name} hold NaN or infinite"):
                evaluation.knn(queries, gallery, 2, use_faiss=use_faiss)
    # finite float64 rows beyond float32's range: knn searches in float32 and says so
    wide = torch.randn(10, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="gallery hold values beyond float32's range"):
        evaluation.knn(wide, wide * 1e300, 2, use_faiss=use_faiss)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int16])
def test_labels_of_any_integer_dtype(dtype):
    """In the self case and against a gallery whose labels have the queries' dtype."""
    x, labels = make_batch(40, 8, 2, dtype=torch.float32, seed=1)
    expected = evaluation.evaluate(x, labels, (1, 5), use_faiss=False)
    assert evaluation.evaluate(x, labels.to(dtype), (1, 5), use_faiss=False) == expected
    queries, gallery = (x[:15], labels[:15]), (x[15:], labels[15:])
    expected = evaluation.evaluate(*queries, (1, 5), gallery=gallery[0], gallery_labels=gallery[1], use_faiss=False)
    assert evaluation.evaluate(queries[0], queries[1].to(dtype), (1, 5), gallery=gallery[0],
                               gallery_labels=gallery[1].to(dtype), use_faiss=False) == expected


def test_map_at_r_without_relevant_rows_is_nan_and_evaluate_goes_on():
    """Every class a single row: Recall@K is 0, MAP@R undefined (NaN, with a warning), as
    pytorch-metric-learning's AccuracyCalculator warns and goes on."""
    x, labels = torch.randn(6, 4), torch.arange(6)
    with pytest.warns(UserWarning, match="MAP@R is undefined"):
        results = evaluation.evaluate(x, labels, (1, 3), use_faiss=False)
    assert results["recall@3"] == 0 and results["map_at_r"] != results["map_at_r"]


@pytest.mark.parametrize("ks", [(1, 4), (2, 4)])
def test_evaluate_searches_once_per_metric(ks, monkeypatch):
    """precision@1 is recall@1 where ks holds 1: no search of its own then."""
    searches = []
    shipped = evaluation._knn_chunks
    monkeypatch.setattr(evaluation, "_knn_chunks", lambda *args: (searches.append(args[2]), shipped(*args))[1])
    x, labels = make_batch(30, 8, 5, dtype=torch.float32, seed=2)
    results = evaluation.evaluate(x, labels, ks, use_faiss=False)
    largest_r = int(torch.bincount(labels).max()) - 1  # (MAP@R's search: the largest R)
    assert searches == ([4, largest_r] if 1 in ks else [4, 1, largest_r])
    assert results["precision_at_1"] == evaluation.recall_at_k(x, labels, (1,), use_faiss=False)[1]


def test_recall_and_map_need_torch_alone():
    """With numpy, faiss and scikit-learn unimportable the module imports and Recall@K and MAP@R give
    the hand-computed values of test_hand_computed_recall_and_map."""
    code = """
import sys
for name in ("numpy", "faiss", "sklearn", "scipy"):
    sys.modules[name] = None  # import of any of them raises ImportError
import torch
from ms_loss_cuda import evaluation
angles = torch.tensor([0.0, 0.1, 0.3, 3.0, 3.1])
x = torch.stack([angles.cos(), angles.sin()], dim=1)
results = evaluation.evaluate(x, torch.tensor([0, 0, 1, 1, 1]), ks=(1, 3))
print(results["recall@1"], results["recall@3"], results["map_at_r"])
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert [float(v) for v in run.stdout.split()] == pytest.approx([4 / 5, 1.0, 4 / 5])


def test_nmi_without_scikit_learn_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.metrics", None)
    with pytest.raises(ImportError, match=r"nmi needs scikit-learn .*pip install scikit-learn"):
        evaluation.nmi(torch.randn(6, 3), torch.arange(6) % 2)
