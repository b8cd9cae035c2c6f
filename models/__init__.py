"""draftsmith.models: trainable drafters, the target wrapper and export formats."""
