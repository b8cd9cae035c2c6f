"""draftsmith.train."""
