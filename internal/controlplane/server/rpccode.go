package server

import (
	"encoding/binary"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"

	"connectrpc.com/connect"
)

// maxCapture bounds what statusWriter keeps of an answer to read its RPC
// code: the last bytes written, which hold a Connect error body, a Connect
// stream's end message or gRPC-Web trailers.
const maxCapture = 4 << 10

type statusWriter struct {
	http.ResponseWriter
	code int
	// tail is the last maxCapture bytes written.
	tail []byte
}

func (w *statusWriter) WriteHeader(c int) { w.code = c; w.ResponseWriter.WriteHeader(c) }

func (w *statusWriter) Write(p []byte) (int, error) {
	if len(p) >= maxCapture {
		w.tail = append(w.tail[:0], p[len(p)-maxCapture:]...)
	} else {
		if over := len(w.tail) + len(p) - maxCapture; over > 0 {
			w.tail = append(w.tail[:0], w.tail[over:]...)
		}
		w.tail = append(w.tail, p...)
	}
	return w.ResponseWriter.Write(p)
}

func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// codeLabel is the metrics code of an answered request (R20.4): for an RPC
// (rpc), the Connect/gRPC code name ("ok", "unauthenticated", …) whatever
// the protocol, since a gRPC error is an HTTP 200 with the code in a
// trailer; else the HTTP status. The values come from a bounded set: a code
// this server wrote (unknown ones are "unknown"), or three digits.
func codeLabel(r *http.Request, sw *statusWriter, rpc bool) string {
	if !rpc {
		return strconv.Itoa(sw.code)
	}
	ct := r.Header.Get("Content-Type")
	switch {
	case strings.HasPrefix(ct, "application/grpc-web"):
		if v, ok := grpcStatus(sw.Header()); ok {
			return v
		}
		return grpcWebTrailerCode(sw.tail)
	case strings.HasPrefix(ct, "application/grpc"):
		if v, ok := grpcStatus(sw.Header()); ok {
			return v
		}
		return connect.CodeUnknown.String()
	case strings.HasPrefix(ct, "application/connect+"):
		return connectEndStreamCode(sw.tail)
	}
	// Connect unary: 200 is ok; an error's body names its code.
	if sw.code == http.StatusOK {
		return "ok"
	}
	var body struct {
		Code string `json:"code"`
	}
	if json.Unmarshal(sw.tail, &body) == nil {
		var c connect.Code
		if c.UnmarshalText([]byte(body.Code)) == nil {
			return c.String()
		}
	}
	return connect.CodeUnknown.String()
}

// grpcStatus reads grpc-status from h: a header in a trailers-only answer,
// or a trailer declared with http.TrailerPrefix.
func grpcStatus(h http.Header) (string, bool) {
	for k, v := range h {
		name := strings.TrimPrefix(k, http.TrailerPrefix)
		if strings.EqualFold(name, "Grpc-Status") && len(v) > 0 {
			return grpcCodeName(v[0]), true
		}
	}
	return "", false
}

// grpcCodeName names a numeric gRPC status.
func grpcCodeName(v string) string {
	n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32)
	if err != nil || n > uint64(connect.CodeUnauthenticated) {
		return connect.CodeUnknown.String()
	}
	if n == 0 {
		return "ok"
	}
	return connect.Code(n).String()
}

// lastEnvelope finds, in the tail of a stream of Connect or gRPC-Web
// envelopes (flags, 4-byte length, payload), the last one whose flags have
// flag: the one that ends the tail exactly.
func lastEnvelope(tail []byte, flag byte) ([]byte, bool) {
	for i := len(tail) - 5; i >= 0; i-- {
		if tail[i]&flag != 0 && int(binary.BigEndian.Uint32(tail[i+1:i+5])) == len(tail)-i-5 {
			return tail[i+5:], true
		}
	}
	return nil, false
}

// grpcWebTrailerCode reads grpc-status from a gRPC-Web trailers frame (flag
// 0x80, "key: value\r\n" lines).
func grpcWebTrailerCode(tail []byte) string {
	payload, ok := lastEnvelope(tail, 0x80)
	if !ok {
		return connect.CodeUnknown.String()
	}
	for line := range strings.SplitSeq(string(payload), "\r\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.EqualFold(strings.TrimSpace(k), "grpc-status") {
			return grpcCodeName(v)
		}
	}
	return connect.CodeUnknown.String()
}

// connectEndStreamCode reads the code of a Connect stream's end-of-stream
// message (flag 0x02, {"error":{"code":…}}; no error is ok).
func connectEndStreamCode(tail []byte) string {
	payload, ok := lastEnvelope(tail, 0x02)
	if !ok {
		return connect.CodeUnknown.String()
	}
	var end struct {
		Error *struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(payload, &end) != nil {
		return connect.CodeUnknown.String()
	}
	if end.Error == nil {
		return "ok"
	}
	var c connect.Code
	if c.UnmarshalText([]byte(end.Error.Code)) != nil {
		return connect.CodeUnknown.String()
	}
	return c.String()
}
