package wire

import (
	"errors"
	"net/http"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protowire"
)

// anyTypePrefix is the type URL prefix of a google.protobuf.Any, as
// connect-go writes an error detail's.
const anyTypePrefix = "type.googleapis.com/"

// GRPCTrailers are the trailers that end a gRPC call with err (nil: OK),
// byte for byte as connect-go's handler writes them for the gRPC
// protocol: grpc-status, grpc-message (percent-encoded) and, when err
// carries details (the product's ErrorDetail, as ToWire adds),
// grpc-status-details-bin, a google.rpc.Status in unpadded base64.
// Sessions served on callbacks (the API's and the gateway's) end with
// these, so bcd reads the same errors on either transport (the session
// package's test compares them with connect-go's).
func GRPCTrailers(err error) http.Header {
	if err == nil {
		return http.Header{"Grpc-Status": {"0"}}
	}
	code, msg := connect.CodeUnknown, err.Error()
	var details []*connect.ErrorDetail
	var ce *connect.Error
	if errors.As(err, &ce) {
		code, msg, details = ce.Code(), ce.Message(), ce.Details()
	}
	h := http.Header{"Grpc-Status": {strconv.Itoa(int(code))}, "Grpc-Message": {grpcPercentEncode(msg)}}
	if len(details) > 0 {
		h["Grpc-Status-Details-Bin"] = []string{connect.EncodeBinaryHeader(grpcStatus(int32(code), msg, details))}
	}
	return h
}

// grpcStatus marshals a google.rpc.Status (code 1, message 2, details 3
// as google.protobuf.Any: type_url 1, value 2), fields in number order
// and zero values left out, as proto.Marshal writes one.
func grpcStatus(code int32, msg string, details []*connect.ErrorDetail) []byte {
	var b []byte
	if code != 0 {
		b = protowire.AppendTag(b, 1, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(code))
	}
	if msg != "" {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendString(b, msg)
	}
	for _, d := range details {
		var a []byte
		a = protowire.AppendTag(a, 1, protowire.BytesType)
		a = protowire.AppendString(a, anyTypePrefix+d.Type())
		if v := d.Bytes(); len(v) > 0 {
			a = protowire.AppendTag(a, 2, protowire.BytesType)
			a = protowire.AppendBytes(a, v)
		}
		b = protowire.AppendTag(b, 3, protowire.BytesType)
		b = protowire.AppendBytes(b, a)
	}
	return b
}

// grpcPercentEncode encodes a grpc-message value as the gRPC spec (and
// connect-go) does: bytes outside printable ASCII, and '%', as %XX.
func grpcPercentEncode(msg string) string {
	const upperhex = "0123456789ABCDEF"
	escape := func(c byte) bool { return c < ' ' || c > '~' || c == '%' }
	n := 0
	for i := range len(msg) {
		if escape(msg[i]) {
			n++
		}
	}
	if n == 0 {
		return msg
	}
	var out strings.Builder
	out.Grow(len(msg) + 2*n)
	for i := range len(msg) {
		if c := msg[i]; escape(c) {
			out.WriteByte('%')
			out.WriteByte(upperhex[c>>4])
			out.WriteByte(upperhex[c&15])
		} else {
			out.WriteByte(c)
		}
	}
	return out.String()
}
