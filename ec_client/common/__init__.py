"""What an engine's scheduler process and its worker processes share.

The session link to the daemon (`session`), the step contract the scheduler
hands its workers (`contract`), the connector's settings (`settings`) and
which socket and region file a client may trust (`trust`). Both sides import
this and neither imports the other, as vLLM's connector halves share
`common.py`: it never imports either side, the copy backends or the vLLM shell.
"""
