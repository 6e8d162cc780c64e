"""A small FastAPI + PyTorch inference server that embeds gpumem-exporter."""
