"""What the chapters (the book) use to show things: labkit's own source and what changed
between stages (``show``), figures (``plots``) and the interactive controls (``widgets``)."""
