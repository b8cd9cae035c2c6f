"""draftsmith.decoding."""
