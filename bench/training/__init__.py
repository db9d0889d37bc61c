"""The training step under test: its levers (``config``), the step (``step``), named presets (``presets``)."""
