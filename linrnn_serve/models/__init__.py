"""Architecture composition. `build_model(cfg, ...)` picks the class for a config."""
from linrnn_serve.models.registry import build_model, model_class

__all__ = ["build_model", "model_class"]
