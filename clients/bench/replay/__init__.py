"""`kvloop bench replay`: a request log replayed through a real kvloopd with a simulated fleet
(``runner``, ``fleet``), its inputs (``trace`` reads logs, ``gen`` makes synthetic traces) and its
report (``report``)."""
