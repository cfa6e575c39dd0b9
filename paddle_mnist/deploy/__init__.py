"""Serving a trained run: the inference export, the Predictor and the predict command."""
