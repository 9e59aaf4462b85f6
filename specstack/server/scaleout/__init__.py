"""``specstack serve --ray``: each role a Ray Serve deployment of replicas behind the same HTTP routes.

Modules, one job each:

- ``prefix``: token prefixes as chained hashes at chunk edges, and the longest match (pure; no Ray)
- ``router``: the ``RequestRouter`` that sends a request to the replica holding its prefix (or its session's)
- ``replica``: one replica = one ``RoleWorker`` (engine and drafters); streams events, publishes prefixes
- ``suffix_share``: the deployment-scoped actor that shares finished outputs with every replica's suffix tree
- ``remote``: the ingress side of a role (``RemoteRole``), what ``create_app`` routes call instead of a worker
- ``metrics_merge``: every replica's Prometheus text, labelled by replica and summed
- ``deploy``: the Serve application, and ``specstack serve --ray`` starting and stopping it

Ray is an extra (``pip install 'specstack[ray]'``); only these modules import it.
"""
