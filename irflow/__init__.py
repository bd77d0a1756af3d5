"""irflow: dense-retriever training recipes as cached, inspectable Prefect pipelines."""

__version__ = "0.1.0"
