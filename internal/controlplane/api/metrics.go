package api

import (
	"net/http"
	"strings"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
)

// OtherRoute is the metrics label of every request that matches no route:
// unknown paths, unknown procedures, malformed paths.
const OtherRoute = "other"

// operatorProcedures lists every operator API procedure,
// "/bettercompute.v1.NodeService/GetNode", read from the schema so a new
// RPC is labelled without a change here.
func operatorProcedures() map[string]bool {
	out := map[string]bool{}
	svcs := bcv1.File_bettercompute_v1_api_proto.Services()
	for i := range svcs.Len() {
		svc := svcs.Get(i)
		for j := range svc.Methods().Len() {
			out["/"+string(svc.FullName())+"/"+string(svc.Methods().Get(j).Name())] = true
		}
	}
	return out
}

// RouteLabel names the route r takes, for metrics: the procedure
// ("/bettercompute.v1.NodeService/GetNode") for an operator API call, the
// mux pattern ("GET /healthz", "GET /api/compute/downloads/bcd/{version}/{file}")
// for the other routes, and OtherRoute for anything else.
//
// SECURITY: the label is decided before authentication, so it must come
// from a bounded set: labelling by the raw path let unauthenticated
// requests to 100,000 distinct paths grow the API from 39 MB to 302 MB of
// metric series. Nothing the caller writes becomes a
// label.
func (s *Server) RouteLabel(r *http.Request) string {
	if rest, ok := strings.CutPrefix(r.URL.Path, s.cfg.BasePath); ok && s.procedures[rest] {
		return rest
	}
	// The same procedure at the root path (R20.4) has the same label.
	if s.procedures[r.URL.Path] {
		return r.URL.Path
	}
	_, pattern := s.mux.Handler(r)
	if pattern == "" || strings.HasSuffix(pattern, "/") {
		// No route, or a service prefix (an unknown procedure under
		// /bettercompute.v1.NodeService/), or a subtree fallback.
		return OtherRoute
	}
	return pattern
}
