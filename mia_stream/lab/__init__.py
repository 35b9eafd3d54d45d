"""The lab: offline work that makes what the runtime loads (probe data collection, training and evaluation,
question generators, head discovery). The runtime (``analyzers``, ``monitor``, ``served``) never imports it."""
