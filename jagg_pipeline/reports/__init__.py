"""Reading finished runs: the summary, the comparison page, MLflow tracking."""
