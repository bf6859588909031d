"""Orchestrator adapters for graphtrim (Airflow provider, Kubeflow components).

Thin by design: they template, place and delegate to ``optimizer_core``.
"""
