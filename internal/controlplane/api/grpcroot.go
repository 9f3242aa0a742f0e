package api

import (
	"net/http"

	"connectrpc.com/connect"
	connectv2 "connectrpc.com/connect/v2"
	"connectrpc.com/connect/v2/connecthttp"
	"connectrpc.com/grpcreflect/v2"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
)

// maxReflectionBytes bounds one reflection request: a symbol or file name.
const maxReflectionBytes = 64 << 10

// operatorServices lists the operator API's services, read from the schema.
func operatorServices() []string {
	svcs := bcv1.File_bettercompute_v1_api_proto.Services()
	out := make([]string, 0, svcs.Len())
	for i := range svcs.Len() {
		out = append(out, string(svcs.Get(i).FullName()))
	}
	return out
}

// mountReflection serves gRPC server reflection (v1 and v1alpha) at the
// root path (R20.4), so grpcurl and other standard tools list and describe
// the operator API without a copy of the schema. It answers for the
// operator services only, and like every operator call it needs an API key
// (grpcurl -H 'authorization: Bearer bck_…'): the check runs before the
// stream is read, with the refusal in the call's protocol (errw).
//
// connect-go v1 has no reflection; connectrpc.com/grpcreflect/v2 runs on
// connect v2's server, which is only this handler's: its wire format is
// gRPC's, whatever either library's version.
func (s *Server) mountReflection(errw *connect.ErrorWriter) {
	names := append(operatorServices(), grpcreflect.ReflectV1ServiceName, grpcreflect.ReflectV1AlphaServiceName)
	rs := connectv2.NewServer()
	grpcreflect.Register(rs, grpcreflect.WithNamer(grpcreflect.NamerFunc(func() []string { return names })))
	inner := http.NewServeMux()
	connecthttp.Mount(inner, rs, connecthttp.WithReadMaxBytes(maxReflectionBytes))
	for _, svc := range []string{grpcreflect.ReflectV1ServiceName, grpcreflect.ReflectV1AlphaServiceName} {
		// authenticateFirst authenticates the procedures it knows.
		s.procedures["/"+svc+"/ServerReflectionInfo"] = true
		s.mux.Handle("/"+svc+"/", s.authenticateFirst(inner, errw))
	}
}
