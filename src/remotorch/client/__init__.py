"""The client: everything here runs in the user's process and talks to workers over a transport.

``connection`` (one worker: the one copy of request, upload and retry policy)
← ``pool`` (the workers of a session) ← ``session`` (the user-facing façade
and the runner captured graphs call); ``embedded`` starts worker processes
on this machine.

This face imports none of them: ``capture`` uses ``client.remote`` and must
not reach the session or the transport, and importing any module of this
package runs this file first. Import from the modules
(``remotorch.client.session.Session``), or take ``remotorch.Session`` and
``remotorch.default_session`` from the package root.
"""
