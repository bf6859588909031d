"""graphtrim's Kubeflow Pipelines adapter: the stages as KFP v2 container components and the
optimize pipeline (``graphtrim.kubeflow.pipeline``), compiled by ``graphtrim kfp compile``; what
a step leaves for the KFP UI, its report and metrics artifacts (``graphtrim.kubeflow.outputs``),
written by ``graphtrim kfp step``."""
