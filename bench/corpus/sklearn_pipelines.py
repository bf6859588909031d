"""Scikit-learn pipelines whose converters write mostly standard operators (kernels, distances,
polynomial features, ensembles' averaging, calibration, text vectorizers), boosted trees through
onnxmltools, and CatBoost's own ONNX exporter. Trained on data sets scikit-learn ships (digits,
diabetes, breast cancer) and on the Zen of Python's lines for text. Built in the scikit-learn
export venv (``.venv-export-sklearn``, ``requirements-export-sklearn.txt``). The
``classical-ml`` family holds the plain estimators (trees, scalers, ZipMap outputs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.corpus import Spec, spec
from bench.corpus.tabular import sklearn_data

PIPELINES = {
    "gaussian-process": "skl2onnx",
    "poly-ridge": "skl2onnx",
    "tfidf-logreg": "skl2onnx",
    "isolation-forest": "skl2onnx",
    "voting-soft": "skl2onnx",
    "stacking": "skl2onnx",
    "feature-union-logreg": "skl2onnx",
    "knn-regressor": "skl2onnx",
    "calibrated-svc": "skl2onnx",
    "lightgbm-regressor": "onnxmltools",
    "xgboost-regressor": "onnxmltools",
    "catboost": "catboost",
}

SPECS: list[Spec] = [
    spec(
        f"skp-{name}",
        "sklearn-pipelines",
        f"{conv}:{name}",
        "bench.corpus.sklearn_pipelines:build",
        exporters=(conv,),
        env="sklearn",
        pipeline=name,
    )
    for name, conv in PIPELINES.items()
]


def _zen_lines() -> tuple[list[str], list[int]]:
    import codecs
    import contextlib
    import io
    import sys

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401
    text = codecs.decode(sys.modules["this"].s, "rot13").lower()
    lines = [ln for ln in text.splitlines() if ln]
    return lines, [int("better" in ln) for ln in lines]


def _fit(name: str) -> tuple[Any, Any]:
    from sklearn import (
        calibration,
        decomposition,
        ensemble,
        feature_selection,
        gaussian_process,
        linear_model,
        naive_bayes,
        neighbors,
        pipeline,
        preprocessing,
        svm,
        tree,
    )

    x, y = sklearn_data("digits")
    xd, yd = sklearn_data("diabetes")
    if name == "gaussian-process":
        kernel = gaussian_process.kernels.RBF() + gaussian_process.kernels.WhiteKernel()
        m = gaussian_process.GaussianProcessRegressor(kernel, random_state=0)
        x, y = xd[:200], yd[:200]
    elif name == "poly-ridge":
        m = pipeline.make_pipeline(
            preprocessing.PolynomialFeatures(2),
            preprocessing.StandardScaler(),
            linear_model.Ridge(),
        )
        x, y = xd, yd
    elif name == "isolation-forest":
        m = ensemble.IsolationForest(n_estimators=20, random_state=0)
    elif name == "voting-soft":
        m = ensemble.VotingClassifier(
            [
                ("lr", linear_model.LogisticRegression(max_iter=300)),
                ("tree", tree.DecisionTreeClassifier(max_depth=6, random_state=0)),
                ("nb", naive_bayes.GaussianNB()),
            ],
            voting="soft",
            flatten_transform=False,
        )
    elif name == "stacking":
        m = ensemble.StackingClassifier(
            [
                ("lr", linear_model.LogisticRegression(max_iter=300)),
                ("tree", tree.DecisionTreeClassifier(max_depth=6, random_state=0)),
            ],
            final_estimator=linear_model.LogisticRegression(max_iter=300),
        )
    elif name == "feature-union-logreg":
        union = pipeline.FeatureUnion(
            [
                ("pca", decomposition.PCA(n_components=12)),
                ("best", feature_selection.SelectKBest(k=20)),
            ]
        )
        m = pipeline.make_pipeline(
            preprocessing.Normalizer(), union, linear_model.LogisticRegression(max_iter=500)
        )
    elif name == "knn-regressor":
        m = neighbors.KNeighborsRegressor(n_neighbors=4, weights="distance")
        x, y = xd, yd
    elif name == "calibrated-svc":
        m = calibration.CalibratedClassifierCV(svm.LinearSVC(random_state=0), cv=3)
    elif name == "lightgbm-regressor":
        import lightgbm

        m = lightgbm.LGBMRegressor(n_estimators=20, num_leaves=15, verbose=-1)
        x, y = xd, yd
    elif name == "xgboost-regressor":
        import xgboost

        m = xgboost.XGBRegressor(n_estimators=20, max_depth=4)
        x, y = xd, yd
    elif name == "catboost":
        import catboost

        m = catboost.CatBoostClassifier(
            iterations=20, depth=4, verbose=False, random_seed=0, allow_writing_files=False
        )
    else:
        raise ValueError(name)
    m.fit(x, y)
    return m, x


def _tfidf() -> Any:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType
    from sklearn import feature_extraction, linear_model, pipeline

    lines, labels = _zen_lines()
    m = pipeline.make_pipeline(
        # lower-cased here: skl2onnx writes lower-casing as a StringNormalizer whose locale
        # (en_US.UTF-8) a machine without it cannot load
        feature_extraction.text.TfidfVectorizer(ngram_range=(1, 2), lowercase=False),
        linear_model.LogisticRegression(max_iter=300),
    )
    m.fit(lines, labels)
    return convert_sklearn(
        m,
        initial_types=[("text", StringTensorType([None, 1]))],
        target_opset={"": 17, "ai.onnx.ml": 3},
        options={id(m.steps[-1][1]): {"zipmap": False}},
    )


def build(pipeline: str) -> Any:
    def write(out: Path, exporter: str) -> dict[str, Any]:
        import onnx

        if pipeline == "tfidf-logreg":
            onnx.save(_tfidf(), str(out))
            return {"dynamic": True}
        model, x = _fit(pipeline)
        if exporter == "skl2onnx":
            from skl2onnx import to_onnx

            onx = to_onnx(model, x[:1], target_opset={"": 17, "ai.onnx.ml": 3})
        elif exporter == "onnxmltools":
            from onnxmltools.convert import convert_lightgbm, convert_xgboost
            from onnxmltools.convert.common.data_types import FloatTensorType

            types = [("input", FloatTensorType([None, x.shape[1]]))]
            convert = convert_lightgbm if pipeline.startswith("lightgbm") else convert_xgboost
            onx = convert(model, initial_types=types, target_opset=15)
        else:  # CatBoost writes the file itself
            model.save_model(str(out), format="onnx")
            return {"dynamic": True}
        onnx.save(onx, str(out))
        return {"dynamic": True}

    return write
