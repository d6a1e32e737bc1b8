"""Scale-out on Ray Serve: one engine per replica behind one endpoint (ray_app.py), the
replica a request goes to (routing.py), starting or joining a cluster (cluster.py), and the
local Ray's environment (environment.py)."""
