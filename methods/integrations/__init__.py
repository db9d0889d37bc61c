"""The suite's methods used from other libraries' models (``transformers``: UPipe as a Transformers
attention function). A subpackage, so ``methods``' import loop, which imports every module
directly in ``methods/`` as a method, leaves it alone; nothing here registers a method."""
