package h2server

import "github.com/better-compute/better-compute/internal/gateway/grpcmsg"

// ErrMessageTooLarge is Messages.Feed's answer to a message over Max.
var ErrMessageTooLarge = grpcmsg.ErrTooLarge

// Messages cuts a gRPC stream's DATA into its messages (grpcmsg.Messages).
type Messages = grpcmsg.Messages

// AppendMessage appends msg as one length-prefixed gRPC message.
func AppendMessage(dst []byte, flags byte, msg []byte) []byte {
	return grpcmsg.Append(dst, flags, msg)
}
