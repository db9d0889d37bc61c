"""The model under test: its configuration (``config``) and the decoder built from it (``decoder``)."""
