"""Classical ML converted with skl2onnx and onnxmltools, trained on data sets scikit-learn ships
(digits, iris, diabetes, breast cancer): ``ai.onnx.ml`` operators (scalers, trees, linear models,
encoders, ZipMap) that an optimizer must leave as they are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.corpus import Spec, spec

PIPELINES = {
    "scaler-logreg": "skl2onnx",
    "random-forest": "skl2onnx",
    "gradient-boosting-regressor": "skl2onnx",
    "decision-tree": "skl2onnx",
    "svc": "skl2onnx",
    "kmeans": "skl2onnx",
    "pca-ridge": "skl2onnx",
    "mlp": "skl2onnx",
    "knn": "skl2onnx",
    "column-transformer": "skl2onnx",
    "lightgbm": "onnxmltools",
    "xgboost": "onnxmltools",
}

SPECS: list[Spec] = [
    spec(
        f"sk-{name}",
        "classical-ml",
        f"{conv}:{name}",
        "bench.corpus.tabular:build",
        exporters=(conv,),
        pipeline=name,
    )
    for name, conv in PIPELINES.items()
]


def sklearn_data(name: str) -> tuple[Any, Any]:
    """A data set scikit-learn ships (``digits``, ``diabetes``, ``iris``): its features as
    float32 and its targets."""
    import numpy as np
    from sklearn import datasets

    data = getattr(datasets, f"load_{name}")()
    return data.data.astype(np.float32), data.target


def _fit(name: str) -> tuple[Any, Any]:
    from sklearn import (
        cluster,
        decomposition,
        ensemble,
        linear_model,
        neighbors,
        neural_network,
        pipeline,
        preprocessing,
        svm,
        tree,
    )

    x, y = sklearn_data("digits")
    if name == "scaler-logreg":
        m = pipeline.make_pipeline(
            preprocessing.StandardScaler(), linear_model.LogisticRegression(max_iter=300)
        )
    elif name == "random-forest":
        m = ensemble.RandomForestClassifier(n_estimators=20, max_depth=8, random_state=0)
    elif name == "gradient-boosting-regressor":
        x, y = sklearn_data("diabetes")
        m = ensemble.GradientBoostingRegressor(n_estimators=30, random_state=0)
    elif name == "decision-tree":
        m = tree.DecisionTreeClassifier(max_depth=10, random_state=0)
    elif name == "svc":
        x, y = sklearn_data("iris")
        m = pipeline.make_pipeline(
            preprocessing.MinMaxScaler(), svm.SVC(probability=True, random_state=0)
        )
    elif name == "kmeans":
        m = cluster.KMeans(n_clusters=10, n_init=2, random_state=0)
    elif name == "pca-ridge":
        m = pipeline.make_pipeline(decomposition.PCA(n_components=16), linear_model.Ridge())
    elif name == "mlp":
        m = pipeline.make_pipeline(
            preprocessing.StandardScaler(),
            neural_network.MLPClassifier(hidden_layer_sizes=(32,), max_iter=200, random_state=0),
        )
    elif name == "knn":
        m = neighbors.KNeighborsClassifier(n_neighbors=5)
    elif name == "lightgbm":
        import lightgbm

        m = lightgbm.LGBMClassifier(n_estimators=20, num_leaves=15, verbose=-1)
    elif name == "xgboost":
        import xgboost

        m = xgboost.XGBClassifier(n_estimators=20, max_depth=4)
    else:
        raise ValueError(name)
    m.fit(x, y)
    return m, x


def _column_transformer() -> Any:
    import numpy as np
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType, StringTensorType
    from sklearn import compose, datasets, linear_model, pipeline, preprocessing

    cancer = datasets.load_breast_cancer()
    num = cancer.data[:, :6].astype(np.float32)
    cat = np.where(cancer.data[:, 6:7] > np.median(cancer.data[:, 6]), "high", "low")
    import pandas as pd

    frame = pd.DataFrame(num, columns=[f"f{i}" for i in range(6)])
    frame["grade"] = cat[:, 0]
    ct = compose.ColumnTransformer(
        [
            ("num", preprocessing.StandardScaler(), [f"f{i}" for i in range(6)]),
            ("cat", preprocessing.OneHotEncoder(handle_unknown="ignore"), ["grade"]),
        ]
    )
    m = pipeline.make_pipeline(ct, linear_model.LogisticRegression(max_iter=500))
    m.fit(frame, cancer.target)
    inputs = [(f"f{i}", FloatTensorType([None, 1])) for i in range(6)]
    inputs.append(("grade", StringTensorType([None, 1])))
    return convert_sklearn(m, initial_types=inputs, target_opset={"": 15, "ai.onnx.ml": 3})


def build(pipeline: str) -> Any:
    def write(out: Path, exporter: str) -> dict[str, Any]:
        import onnx

        if pipeline == "column-transformer":
            onx = _column_transformer()
        else:
            model, x = _fit(pipeline)
            if exporter == "skl2onnx":
                from skl2onnx import to_onnx

                onx = to_onnx(model, x[:1], target_opset={"": 17, "ai.onnx.ml": 3})
            else:
                from onnxmltools.convert import convert_lightgbm, convert_xgboost
                from onnxmltools.convert.common.data_types import FloatTensorType

                types = [("input", FloatTensorType([None, x.shape[1]]))]
                convert = convert_lightgbm if pipeline == "lightgbm" else convert_xgboost
                onx = convert(model, initial_types=types, target_opset=15)
        onnx.save(onx, str(out))
        return {"dynamic": True}

    return write
