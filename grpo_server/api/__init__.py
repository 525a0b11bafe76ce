"""The public HTTP API: the app, the edge every route shares, one folder per API family (`native/`, `openai/`,
`tinker/`) each exporting one route table, /openapi.json, /metrics and the status page. Calls into `runtime`;
nothing below imports it."""
