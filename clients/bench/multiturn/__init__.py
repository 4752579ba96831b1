"""`kvloop bench multiturn`: continuation-turn TTFT on real engines, arm against arm (``runner``), the
sessions and arms it plays (``setup``, ``arms``), and its summary, tables and plots (``summary``,
``tables``, ``plot``)."""
