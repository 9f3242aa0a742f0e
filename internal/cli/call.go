package cli

import (
	"context"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/better-compute/better-compute/internal/client"
)

// The plumbing of the commands that make one API call and print its answer
// (get, list, and the simple create, revoke and retire): the required
// flags are checked before anything is sent, then the client is built, the
// call made, and the answer printed as JSON with --json, else by the
// command's show function. A command body is then its request and its
// table.

// need is the flags a command requires, as name, value pairs in the order
// they are checked: the first one missing is the error (--NAME required).
type need []string

func (n need) check() error {
	for i := 0; i+1 < len(n); i += 2 {
		if err := required(n[i], n[i+1]); err != nil {
			return err
		}
	}
	return nil
}

// runCall checks flags, makes one call and prints its answer: the message
// as JSON with --json, else show's table.
func runCall[R any](a *app, cmd *cobra.Command, flags need, call func(ctx context.Context, c *client.Client) (*connect.Response[R], error), show func(*R) error) error {
	if err := flags.check(); err != nil {
		return err
	}
	c, err := a.client()
	if err != nil {
		return err
	}
	res, err := call(cmd.Context(), c)
	if err != nil {
		return err
	}
	if a.wantJSON() {
		return a.printJSON(res.Msg)
	}
	return show(res.Msg)
}

// runList checks flags, reads every page of a List call and prints the
// items: with --json as one List response holding them all, else with
// show's table.
func runList[T proto.Message, R any, PR pageOf[T, R]](a *app, cmd *cobra.Command, flags need, page func(ctx context.Context, c *client.Client, token string) (*connect.Response[R], error), show func(...T) error) error {
	if err := flags.check(); err != nil {
		return err
	}
	items, err := listAll[T, R, PR](a, func(c *client.Client, token string) (*connect.Response[R], error) {
		return page(cmd.Context(), c, token)
	})
	if err != nil {
		return err
	}
	if a.wantJSON() {
		return a.printJSON(pageWith[T, R, PR](items))
	}
	return show(items...)
}

// pageWith returns a List response holding items and no next page: what
// `list --json` prints, as if one page had held every item. Every List
// response names its items "items".
func pageWith[T proto.Message, R any, PR pageOf[T, R]](items []T) PR {
	m := PR(new(R))
	r := m.ProtoReflect()
	l := r.Mutable(r.Descriptor().Fields().ByName("items")).List()
	for _, it := range items {
		l.Append(protoreflect.ValueOfMessage(it.ProtoReflect()))
	}
	return m
}

// one adapts a show function of many items to one item, for runCall.
func one[T any](show func(...T) error) func(T) error {
	return func(t T) error { return show(t) }
}
