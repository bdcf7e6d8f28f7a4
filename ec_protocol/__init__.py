"""What the daemon and its clients share: the protocol.

The generated stubs (`_proto`, built from proto/ by proto/generate.py), the
wire constants and the layout fingerprint (`protocol`), the stamp table's
layout in the region (`stamps`) and the channel (`transport`). Neither
`ec_daemon` nor `ec_client` imports the other; both import this.
"""
