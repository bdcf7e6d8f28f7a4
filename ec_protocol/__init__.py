"""What the daemon and its clients share: the protocol.

The generated stubs (`_proto`, built from proto/ by proto/generate.py), the
wire constants and the layout fingerprint (`protocol`), the stamp table's
layout in the region (`stamps`), the channel (`transport`), byte sizes as
people write them (`sizes`) and the one shape of a settings table, the
daemon's flags and the connector's keys alike (`settings_table`). Neither
`ec_daemon` nor `ec_client` imports the other; both import this.
"""
