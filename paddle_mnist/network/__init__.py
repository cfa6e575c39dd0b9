"""The networks: the models, the layers they are built of, their dropout, the whitened first layer and the summary."""
