"""The networks: the models, their dropout, the whitened first layer and the summary."""
