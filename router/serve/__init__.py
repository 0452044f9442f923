"""The running router: the app (dispatch, proxy hot path, local answers) and its server."""
